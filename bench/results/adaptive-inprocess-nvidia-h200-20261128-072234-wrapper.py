import logging, runpy, sys
from spruce.speculative import adaptive_policy as ap
orig = ap._ahead
def ahead(spec_tokens, seconds, margin):  # a due probe of rounds waits for detached requests as served (parts in reach)
    if margin == -ap.PROBED_MARGIN and sys._getframe(1).f_code.co_name == "_explore":
        return True
    return orig(spec_tokens, seconds, margin)
ap._ahead = ahead
logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
logging.getLogger("spruce.adaptive").setLevel(logging.INFO)
sys.argv = ["adaptive_inprocess.py", "--model", ".carry/models/pycode-19m", "--draft", "bench/assets/pycode-19m-eagle3",
            "--concurrency", "1", "--repeats", "4", "--requests", "256", "--warm-runs", "1", "--idle-gaps",
            "--scheduler-delay-factor", "4", "--per-request", "--out-dir", sys.argv[1] if len(sys.argv) > 1 else "/tmp"]
import os; sys.argv[-1] = os.environ["OUT"]
runpy.run_path("bench/adaptive_inprocess.py", run_name="__main__")
