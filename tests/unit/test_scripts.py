"""Every script in scripts/ follows one convention: its parser from `cli.parser`, its `main` run by `cli.run`,
`--help` printing its docstring, and a wrong argument ending it with one line `error: ...` and exit status 2."""

import ast
import contextlib
import io
import runpy
import sys

import pytest

from eagle3_datagen.cli import USER_ERROR_EXIT
from tests.helpers import REPO

SCRIPTS = sorted((REPO / "scripts").glob("*.py"))


def run_script(script, *args) -> tuple[int, str, str]:
    """The script run as `python script args` would run it, here in this process (each import once for all)."""
    out, err = io.StringIO(), io.StringIO()
    argv = sys.argv
    sys.argv = [str(script), *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as ended:
            runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = argv
    return ended.value.code or 0, out.getvalue(), err.getvalue()


def calls(tree: ast.AST) -> set[str]:
    return {ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.name)
def test_script_follows_the_cli_convention(script):
    tree = ast.parse(script.read_text())
    assert "cli.parser" in calls(tree) and "argparse.ArgumentParser" not in calls(tree), script.name
    guard = tree.body[-1]
    assert isinstance(guard, ast.If) and ast.unparse(guard.test) == "__name__ == '__main__'", script.name
    assert ast.unparse(guard.body[0]).startswith("cli.run(main"), script.name

    status, out, err = run_script(script, "--help")
    assert (status, err) == (0, "")
    assert out.startswith(f"usage: {script.name} ")
    assert ast.get_docstring(tree).splitlines()[0] in out

    status, out, err = run_script(script, "--no-such-option")
    assert (status, out) == (USER_ERROR_EXIT, "")
    assert err.splitlines() == [err.strip()] and err.startswith("error: ") and f"(see {script.name} --help)" in err
