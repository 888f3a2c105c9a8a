"""Training: ``config`` (``DataConfig``, ``TrainConfig``), ``trainer`` (``MCLTrainer``, transformers' Trainer with the
MCL loss), ``checkpoints`` (whole-or-absent checkpoints, resume), ``runs`` (a run's settings and records) and ``fit``
(a run from its settings: `loramcl train` and `loramcl nll`, and the training stage every recipe runs)."""
