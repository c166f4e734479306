"""perf.drift, the in-process drift experiment of issue 29 item 4: it runs on the CPU and reports per allocation."""
import pytest

from perf import drift


def test_drift_times_each_allocation_and_summarizes(capsys):
    assert drift.main(["--allocations", "2", "--runs", "1", "--tokens", "4", "--methods", "ar"]) == 0
    out = capsys.readouterr().out
    assert "allocation 0 ar" in out and "allocation 1 ar" in out
    assert "ar: median per allocation" in out


@pytest.mark.parametrize("args", [["--methods", "ar,beam"], ["--methods", "ddtree-x"], ["--allocations", "0"], ["--tokens", "1"]])
def test_drift_refuses_bad_arguments(args, capsys):
    with pytest.raises(SystemExit) as e:
        drift.main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "bad method" in err or ">= 1" in err
