"""gettext catalogs written for the tests: the machine's catalogs are the data of the translation, bilingual and
spoken translation recipes, and the tests give them catalogs of their own."""

import struct

HEADER = "Content-Type: text/plain; charset=UTF-8\n"


def write_mo(path, messages: dict[str, str]) -> None:
    """A GNU .mo catalog (format of `msgfmt`): magic, counts, two (length, offset) tables, NUL-ended strings."""
    entries = sorted({"": HEADER, **messages}.items())
    ids = [k.encode() for k, _ in entries]
    strs = [v.encode() for _, v in entries]
    start = 7 * 4 + 16 * len(entries)
    table_ids, table_strs, blob = [], [], b""
    for collection, table in ((ids, table_ids), (strs, table_strs)):
        for s in collection:
            table.append((len(s), start + len(blob)))
            blob += s + b"\0"
    head = struct.pack("<7I", 0x950412DE, 0, len(entries), 28, 28 + 8 * len(entries), 0, 0)
    tables = b"".join(struct.pack("<2I", *e) for e in table_ids + table_strs)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(head + tables + blob)


def locale(tmp_path, catalogs: dict[str, dict[str, dict[str, str]]]):
    """catalogs: {language: {domain: {msgid: msgstr}}} -> a locale folder."""
    for lang, domains in catalogs.items():
        for domain, messages in domains.items():
            write_mo(tmp_path / lang / "LC_MESSAGES" / f"{domain}.mo", messages)
    return tmp_path
