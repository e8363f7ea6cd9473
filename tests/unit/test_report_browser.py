"""The summary page as a person sees it: Debian's real headless chromium lays it out at 1,366 px wide (a
common laptop) and the page must not scroll sideways (`make test` installs chromium: `make slurm-packages`)."""

import shutil
import subprocess

import pytest

from eagle3_datagen.chat.gates import pooled
from eagle3_datagen.formats.files import write_json
from eagle3_datagen.reporting.report import data_curves, partition_summary, summary_html
from eagle3_datagen.stages.prompts import build_prompts
from tests.helpers import REPO

REALDATA = REPO / "tests" / "fixtures" / "realdata"
CHROMIUM = shutil.which("chromium")
WIDTH = 1366
# Appended to the page: once laid out, the widths the browser measured, written into the DOM it dumps.
MEASURE = (
    "<script>window.addEventListener('load', () => { const d = document.createElement('pre');"
    " d.id = 'measured'; d.textContent = document.documentElement.scrollWidth + ' ' + window.innerWidth;"
    " document.body.appendChild(d); });</script>"
)


def laid_out_widths(page: str, path) -> tuple[int, int]:
    """(the page's scroll width, the window's inner width) as chromium lays `page` out at WIDTH px."""
    path.write_text(page.replace("</body>", MEASURE + "</body>"))
    dom = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--window-size={WIDTH},900"]
        + ["--virtual-time-budget=5000", "--dump-dom", path.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    scroll, inner = dom.split('<pre id="measured">')[1].split("</pre>")[0].split()
    return int(scroll), int(inner)


def drafts(partition: str, levels: dict[int, int], with_baseline: bool) -> list[dict]:
    """Evaluation figures as stages/evaluate/measure.py writes them (acceptance.json and curve/*.json) of
    drafts at `levels` ({samples: accepted proposals per verify step}) on four held-out prompts."""
    settings = {"seed": 0, "speculative": {"num_steps": 3}}
    out = []
    for samples, accepted in levels.items():
        per_prompt = [{"id": f"p{n}", "accepted": [min(3, accepted + n % 2)] * 8} for n in range(4)]
        figures = {"partition": partition, "samples": samples, "per_prompt": per_prompt, "settings": settings}
        if with_baseline:
            figures["baseline"] = {"samples": samples, "per_prompt": [{**p, "accepted": [0] * 8} for p in per_prompt]}
        out.append(figures)
    return out


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make slurm-packages, as root)")
def test_the_summary_page_fits_a_1366_px_window_in_a_real_browser(tmp_path):
    summaries, evaluations, points = [], [], []
    for name, source, fmt in (
        ("code_with_a_long_partition_name", REALDATA / "python_code_23k_sharegpt.jsonl", "sharegpt"),
        ("hermes", REALDATA / "openhermes_2_5.jsonl", "auto"),
        ("third", REALDATA / "openhermes_2_5.jsonl", "auto"),
    ):
        build_prompts(source, fmt, [tmp_path / f"{name}.jsonl.zst"], tmp_path / f"{name}.stats.json")
        summary = partition_summary(name, str(tmp_path / f"{name}.stats.json"), [], [], [])
        # a partition whose gates dropped rows: the widest table (every reason a column)
        summary["gates"] = pooled(
            [{"rows": 40, "dropped_rows": 3, "off": [], "counts": {"truncated": 2, "refusal": 1}}]
        )
        summaries.append(summary)
        whole, *smaller = drafts(name, {32: 2, 16: 1, 8: 1}, with_baseline=name == "hermes")
        evaluations.append(
            {
                **whole,
                "acceptance_length": 2.9,
                "interval_95": [2.5, 3.2],
                "acceptance_by_position": [0.8, 0.5, 0.3],
                "trainer_estimate": {"acceptance_length": 3.0},
                "prompts": 4,
                "verify_steps": 32,
                "measured_by": "greedy chain speculative decoding",
                "baseline": {
                    **whole["baseline"],
                    "acceptance_length": 1.0,
                    "difference": 1.9,
                    "difference_interval_95": [1.5, 2.2],
                }
                if "baseline" in whole
                else None,
            }
        )
        points += smaller
    curves = data_curves(evaluations, points, summaries)
    assert [c["partition"] for c in curves] == ["code_with_a_long_partition_name", "hermes", "third"]
    page = summary_html(summaries, None, evaluations, curves)
    write_json(tmp_path / "curves.json", curves)
    # the verdicts, the curve's plot and its table; every number folded away
    assert page.count("<section class='verdict'>") == 3 and "How much data is enough" in page
    assert "<details><summary><b>All numbers</b></summary>" in page
    # hermes's card alone has the curve of the drafts on the dataset's own responses (the only baseline here)
    hermes = next(c for c in curves if c["partition"] == "hermes")
    assert [c["baseline_brief"] is None for c in curves] == [True, False, True]
    assert page.count("<dt>more data, the dataset's own responses</dt>") == 1 and hermes["baseline_brief"] in page

    scroll, inner = laid_out_widths(page, tmp_path / "summary.html")
    assert inner == WIDTH and scroll <= inner, f"the page scrolls sideways: {scroll} px wide in a {inner} px window"
    # the check sees a page that does scroll: the old page's plots were 1,500 px wide, three panels a row
    scroll, inner = laid_out_widths("<html><body><img width='1500' height='10'/></body></html>", tmp_path / "wide.html")
    assert scroll > inner == WIDTH
