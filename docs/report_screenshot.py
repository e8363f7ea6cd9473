#!/usr/bin/env python
"""Render the report page to a PNG for the README (docs/report.png).

No browser is needed: WeasyPrint lays the HTML out to PDF and pdfium rasterises it. Both are
documentation tools only, kept out of the project's environment:
  uv venv /tmp/shot && uv pip install --python /tmp/shot/bin/python weasyprint==70.0 pypdfium2==5.15.2
  /tmp/shot/bin/python docs/report_screenshot.py results/report/summary.html docs/report.png
"""

import argparse

import pypdfium2
import weasyprint
from PIL import Image

PAGE_CSS = """
@page { size: 1300px 2000px; margin: 16px }
body { font-family: sans-serif; font-size: 12px }
img.plot { max-width: 100% }
table { border-collapse: collapse }
td, th { border: 1px solid #999; padding: 1px 4px }
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("html", help="the report page, e.g. results/report/summary.html")
    p.add_argument("png", help="image to write (the first page)")
    p.add_argument("--scale", type=float, default=1.0)
    args = p.parse_args()
    pdf = weasyprint.HTML(filename=args.html).write_pdf(stylesheets=[weasyprint.CSS(string=PAGE_CSS)])
    page = pypdfium2.PdfDocument(pdf)[0]
    image = page.render(scale=args.scale).to_pil()
    image.convert("P", palette=Image.Palette.ADAPTIVE, colors=128).save(args.png, optimize=True)


if __name__ == "__main__":
    main()
