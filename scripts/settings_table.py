#!/usr/bin/env python
"""Print the table of every config setting (key, kind, default, description) generated from
src/eagle3_datagen/config.schema.yaml, or with --write put it into docs/settings.md between its markers
(tests/unit/test_settings_said_once.py fails while the page's table differs from the schema's)."""

from pathlib import Path

from eagle3_datagen import cli
from eagle3_datagen.formats.files import atomic_path
from eagle3_datagen.workflow.settings_doc import settings_table, with_table


def main() -> None:
    p = cli.parser(__doc__, stage_settings=False)
    p.add_argument("--write", metavar="PAGE", nargs="?", const="docs/settings.md", help="the page to update in place")
    args = p.parse_args()
    if args.write is None:
        print(settings_table())
        return
    page = Path(args.write)
    text = with_table(page.read_text(), args.write)
    with atomic_path(page) as tmp:
        tmp.write_text(text)


if __name__ == "__main__":
    cli.run(main, (ValueError,))
