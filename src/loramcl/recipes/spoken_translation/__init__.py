"""Spoken English messages transcribed OR translated to French by Whisper-base (`loramcl spoken-translation`)."""
