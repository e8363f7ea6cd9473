"""The suite's skip policy, run on a small test file of its own."""

from tests.helpers import REPO


def test_only_gpu_tests_skip_and_every_skip_says_why(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    pytester.makeconftest('pytest_plugins = ["tests.skip_policy"]')
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.gpu
        def test_on_a_gpu():
            pass

        def test_that_skips_on_cpu():
            pytest.skip("no reason to run")

        def test_plain():
            pass
        """
    )
    result = pytester.runpytest_subprocess("-ra")
    result.assert_outcomes(passed=1, skipped=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*test_that_skips_on_cpu skipped (Skipped: no reason to run), but only tests marked gpu or mount may skip*",
            "*SKIPPED*GPU-only: torch.cuda.is_available() is False on this machine*",
        ]
    )
