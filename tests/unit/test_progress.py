"""Progress lines as a job logs them: plain lines with counts, rate, failures, cost and ETA."""

import logging

from eagle3_datagen.progress import Progress


def test_progress_in_a_log_file_is_plain_lines(caplog):
    logger = logging.getLogger("test.progress")
    progress = Progress(3, "prompts", logger, interval=0.0)
    with caplog.at_level("INFO", logger="test.progress"):
        for i in range(3):
            progress.advance(tokens=15, failed=i == 1, cost=0.5)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and lines[-1].startswith("progress: 3/3 prompts, ")
    assert "tokens/s, 1 failed, $1.5000, ETA 0 s" in lines[-1]
    assert not any("\r" in line for line in lines)
