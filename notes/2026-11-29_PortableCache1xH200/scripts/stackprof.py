"""train_gpt.py with torch.profiler's Python stacks on (--profile-steps traces then name Python functions)."""
import os, runpy, sys
sys.path.insert(0, os.getcwd())
import torch
_Profile = torch.profiler.profile
class _WithStack(_Profile):
    def __init__(self, *a, **k):
        k.setdefault("with_stack", True)
        super().__init__(*a, **k)
torch.profiler.profile = _WithStack
sys.argv = ["train_gpt.py"] + sys.argv[1:]
runpy.run_path("train_gpt.py", run_name="__main__")
