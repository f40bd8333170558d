"""A real two-rank Lightning job, run as a script (``python tests/dist/_exit_job.py``) by ``test_clean_exit.py``.

A tiny Hugging Face ``LlamaForCausalLM`` trains 2 SGD steps under ``V17Strategy(tp=2)`` on the model's own TP plan;
Lightning's launcher starts rank 1 as a subprocess of this script. After ``fit`` the script does what many training
scripts do last: it sums a number over the ranks (a gloo all-reduce of a temporary tensor) and rank 0 prints it, so
that collective is the last thing rank 1 does before its interpreter exits.

Whether a gloo worker is still busy with that collective's tensor when the interpreter finalizes (the abort
``strategies/_collectives.py`` prevents) depends on the load of the machine. So each rank also checks the condition
itself, from an ``atexit`` hook registered before any other (hooks run last-in first-out, so it runs after V17's):
no gloo thread may be left when the interpreter starts to finalize. It reports on stderr what it finds.
"""

from __future__ import annotations

import atexit
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root

#: gloo's worker threads (``ProcessGroupGloo::runLoop``) and its transport's event loop, as the kernel names them
GLOO_THREADS = ("pt_gloo", "gloo_tcp")


def gloo_threads() -> int:
    """How many threads of this process gloo runs (Linux: the names in ``/proc/self/task/*/comm``)."""
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                count += f.read().startswith(GLOO_THREADS)
        except OSError:  # the thread ended meanwhile
            pass
    return count


def _check_gloo_threads() -> None:
    left = gloo_threads()
    rank = os.environ.get("LOCAL_RANK", "0")
    # one write(2) per line: both ranks share the test's stderr pipe, and print() writes the line and its end apart
    os.write(2, f"exit-check rank {rank}: {left} gloo threads alive as the interpreter finalizes\n".encode())


def main() -> None:
    import warnings

    atexit.register(_check_gloo_threads)
    warnings.filterwarnings("ignore")
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_v17 import V17Strategy
    from tests._models import lightning_module, token_dataset

    L.seed_everything(1, verbose=False)
    module = lightning_module("hf_llama", layers=2)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=V17Strategy(tp=2), max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module, DataLoader(token_dataset("hf_llama", rows=16), batch_size=4, shuffle=False))
    weight = module.model.lm_head.weight
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    total = trainer.strategy.reduce(local.detach().abs().sum().reshape(1), reduce_op="sum")
    if trainer.global_rank == 0:  # rank 1 exits right after the collective
        print(f"fit done, |lm_head| summed over the tp ranks {float(total):.6f}", flush=True)


if __name__ == "__main__":
    main()
