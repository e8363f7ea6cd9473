"""The docs stay true: every setting key, rule name, repo path and command they quote in code spans and
code blocks exists (keys in the schema, rules in the workflow, paths in the tree, scripts' flags in their
`--help`, `snakemake` flags in its own, profiles and make targets where the repo has them). A planted
stale key fails the same check."""

import functools
import re
import subprocess
import sys
from pathlib import Path

from eagle3_datagen import config_schema
from tests.helpers import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SCHEMA_KEYS = set(config_schema.leaf_keys())
# Every prefix of a leaf key names a section (`evaluate`, `hidden_states.sglang`) or the key itself.
SECTIONS = {".".join(k.split(".")[:n]) for k in SCHEMA_KEYS for n in range(1, k.count(".") + 2)}
TOP_SECTIONS = {k.split(".")[0] for k in SCHEMA_KEYS}
# What a run writes (results/, logs/ ...) or installs (venvs) is named in the docs but not in the tree.
RUN_OUTPUTS = ("results/", "logs/", "benchmarks/", "data/", ".venv", ".snakemake/", ".leases/", "/")
PACKAGE = REPO / "src" / "eagle3_datagen"
CODE = re.compile(r"```[^\n]*\n(.*?)```|`((?:[^`\n]|\n(?!\s*\n))+)`", re.S)


def quoted(text: str) -> list[str]:
    """The text of every code block, and of every code span as one line (a span may wrap)."""
    return [block or " ".join(span.split()) for block, span in CODE.findall(text)]


def rule_names() -> set[str]:
    """The workflow's rules: `rule X:` and `use rule ... as X`, and the per-partition `prompts_*` rules."""
    sources = [REPO / "Snakefile", *sorted((REPO / "rules").glob("*.smk"))]
    text = "\n".join(p.read_text() for p in sources)
    return set(re.findall(r"^rule (\w+):", text, re.M)) | set(re.findall(r"^use rule \w+ as (\w+)", text, re.M))


def make_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return {t for line in re.findall(r"^([\w .-]+):(?!=)", text, re.M) for t in line.split()}


# Each script's `--help` in one process: the scripts' shared imports (torch, transformers) load once.
HELP_ALL = """
import contextlib, io, runpy, sys
for script in sys.argv[1:]:
    out = io.StringIO()
    sys.argv = [script, "--help"]
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        runpy.run_path(script, run_name="__main__")
    print(f"==> {script}\\n{out.getvalue()}")
"""


HELPS: dict[str, str] = {}  # each script's --help, once per test process


def script_helps(scripts: set[str]) -> dict[str, str]:
    """`--help` of each of `scripts` (paths under the repo)."""
    missing = sorted(scripts - set(HELPS))
    if missing:
        command = [sys.executable, "-c", HELP_ALL, *missing]
        proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        HELPS.update(re.findall(r"^==> (\S+)\n(.*?)(?=^==> |\Z)", proc.stdout, re.M | re.S))
    return HELPS


@functools.cache
def snakemake_help() -> str:
    snakemake = str(Path(sys.executable).parent / "snakemake")
    return subprocess.run([snakemake, "--help"], cwd=REPO, capture_output=True, text=True, check=True).stdout


# A dotted word ending so is a file or tensor name (`export.json`, `model.norm.weight`), not a key.
NOT_KEYS = ("json", "pt", "yaml", "npy", "safetensors", "weight", "zst", "gz")
# A repo path starts at the repo's root or the package's (`stages/evaluate/draft.py`).
ROOTS = {p.name for p in REPO.iterdir() if not p.name.startswith(".git")} | {p.name for p in PACKAGE.iterdir()}


def setting_key(word: str) -> str | None:
    """`word` as a dotted schema key (a partition's name as `*`, a whole section as `section.*`), if it is
    meant as one."""
    parts = word.split(".")
    if len(parts) < 2 or parts[0] not in TOP_SECTIONS or parts[-1] in NOT_KEYS:
        return None
    if not all(re.fullmatch(r"[\w*]+", p) for p in parts):
        return None
    if parts[0] == "partitions":
        parts[1] = "*"
    if parts[-1] == "*" and len(parts) > 2 or parts[0] != "partitions" and parts[-1] == "*":
        parts = parts[:-1]
    return ".".join(parts)


def path_exists(word: str, page: Path) -> bool:
    """`word` names a file or folder of the repo (`workflow/settings.cluster_job`: a module's attribute)."""
    word = re.sub(r"(::\w+|:\d+)$", "", word.rstrip(":,."))
    candidates = {word, re.sub(r"\.\w+$", ".py", word)}
    return any((base / c).exists() for base in (REPO, PACKAGE, page.parent) for c in candidates)


def looks_like_path(word: str) -> bool:
    """A path from the repo's or the package's root; placeholders (`profiles/NAME`) and run outputs aside."""
    if any(c in word for c in "{}*<>$ ") or word.startswith(RUN_OUTPUTS) or "/" not in word:
        return False
    parts = word.rstrip("/").split("/")
    return parts[0] in ROOTS and not any(re.fullmatch(r"[A-Z_]+", p) for p in parts)


def after_prompt(words: list[str], i: int) -> bool:
    """Whether words[i] starts a command: the line's first word or one after `$`, `&&`, `;` or `(`."""
    return i == 0 or words[i - 1] in ("$", "&&", ";", "(")


def command_problems(line: str, targets: set[str], flags_of: dict[str, list[str]]) -> list[str]:
    """What a quoted command line names that does not exist; each script's flags go to `flags_of`, to be
    checked against its `--help`."""
    problems = []
    words = line.split()
    for i, word in enumerate(words):
        if re.fullmatch(r"scripts/\w+\.py", word):
            if not (REPO / word).exists():
                problems.append(f"script {word}")
            else:
                flags_of.setdefault(word, []).extend(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", " ".join(words[i + 1 :])))
            break
        if word == "snakemake" and after_prompt(words, i):
            rest = words[i + 1 :]
            for j, arg in enumerate(rest):
                if arg.startswith("--") and not re.search(rf"{arg.split('=')[0]}\b", snakemake_help()):
                    problems.append(f"snakemake {arg}")
                if arg == "--profile" and j + 1 < len(rest) and "{" not in rest[j + 1]:
                    profile = rest[j + 1]
                    if not ((REPO / profile).is_dir() or (REPO / "profiles" / profile).is_dir()):
                        problems.append(f"profile {profile}")
            break
        if word == "make" and after_prompt(words, i):
            problems += [
                f"make target {t}" for t in words[i + 1 :] if re.fullmatch(r"[a-z][\w-]*", t) and t not in targets
            ]
            break
    return problems


def doc_problems(pages: list[Path]) -> list[str]:
    """`page: what` for every quoted key, rule, path or command of `pages` that does not exist."""
    rules, targets = rule_names(), make_targets()
    problems = []
    flags_of = {}  # per page: script -> the flags the page gives it
    for page in pages:
        flags_of[page] = {}
        text = page.read_text()
        absent = set(re.findall(r"\b[Nn]o `([^`]+)`", text))  # "there is no `profiles/default`"
        for code in quoted(text):
            for line in code.splitlines():
                problems += [f"{page.name}: {p}" for p in command_problems(line.strip(), targets, flags_of[page])]
            for word in re.findall(r"[^\s`'\"(),]+", code):
                key = setting_key(word.rstrip(":.,"))
                if key is not None and key not in SECTIONS:
                    problems.append(f"{page.name}: setting key {word}")
                elif key is None and looks_like_path(word) and word not in absent and not path_exists(word, page):
                    problems.append(f"{page.name}: path {word}")
        # a rule named as one: "the `X` rule", "rule `X`"
        for name in re.findall(r"`(\w+)` rules?\b|\brules? `(\w+)`", text):
            name = "".join(name)
            if name not in rules and not name.startswith("prompts_"):
                problems.append(f"{page.name}: rule {name}")
    helps = script_helps({script for scripts in flags_of.values() for script in scripts})
    for page, scripts in flags_of.items():
        for script, flags in scripts.items():
            problems += [
                f"{page.name}: {script} {f}" for f in dict.fromkeys(flags) if not re.search(rf"{f}\b", helps[script])
            ]
    return problems


def test_every_key_rule_path_and_command_the_docs_quote_exists():
    problems = doc_problems(PAGES)
    assert not problems, "\n".join(problems)


def test_a_planted_stale_key_rule_path_and_flag_fail_the_check(tmp_path):
    page = tmp_path / "stale.md"
    page.write_text(
        "Set `evaluate.train_steps` (renamed), run the `evaluate_partition` rule, read\n"
        "`src/eagle3_datagen/stages/evaluate/run.py`, then\n"
        "```\npython scripts/evaluate.py --partition P --held-out H.jsonl\nmake no-such-target\n```\n"
        "Fine: `evaluate.steps`, the `evaluate_vocab` rule, `scripts/evaluate.py`, `make demo`.\n"
    )
    assert sorted(doc_problems([page])) == [
        "stale.md: make target no-such-target",
        "stale.md: path src/eagle3_datagen/stages/evaluate/run.py",
        "stale.md: rule evaluate_partition",
        "stale.md: scripts/evaluate.py --held-out",
        "stale.md: setting key evaluate.train_steps",
    ]
