"""The ``v17`` console script.

- ``v17 plan ...``: the torch-free memory/parallelism planner (lightning_v17/planner/cli.py).
- ``v17 consolidate CKPT OUT``: a sharded checkpoint -> one full state dict (lightning_v17/checkpoint/sharded.py).
- ``v17 convert-deepspeed DIR OUT``: a DeepSpeed ZeRO checkpoint -> a sharded checkpoint
  (lightning_v17/checkpoint/deepspeed_convert.py).
- ``v17 preprocess INPUTS --output PREFIX``: jsonl/text -> Megatron ``.bin/.idx`` token files
  (lightning_v17/data/preprocess.py).
- ``v17 fit|validate|test|predict ...``: a LightningCLI (lightning_v17/trainer_cli.py), e.g.
  ``v17 fit --config configs/tiny-cpu.yaml``.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv else ""
    if command == "plan":
        from lightning_v17.planner.cli import main as plan_main

        return plan_main(argv[1:])
    if command == "consolidate":
        from lightning_v17.checkpoint.sharded import consolidate_main

        return consolidate_main(argv[1:])
    if command == "convert-deepspeed":
        from lightning_v17.checkpoint.deepspeed_convert import convert_deepspeed_main

        return convert_deepspeed_main(argv[1:])
    if command == "preprocess":
        from lightning_v17.data.preprocess import preprocess_main

        return preprocess_main(argv[1:])
    if command in ("-h", "--help", ""):
        print(__doc__.strip())
        return 0 if command else 2
    from lightning_v17.trainer_cli import run_lightning_cli

    run_lightning_cli(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
