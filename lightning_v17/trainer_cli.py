"""``v17 fit|validate|test|predict``: a LightningCLI over :class:`LlamaLM` and :class:`PackedDataModule`.

Every option is a typed constructor argument with an ``Args:`` docstring, so ``v17 fit --help`` documents them all;
a run is described in YAML (``v17 fit --config configs/tiny-cpu.yaml``), with ``class_path``/``init_args`` for the
strategy and callbacks.
"""

from __future__ import annotations

import sys

from lightning.pytorch.cli import LightningCLI

from lightning_v17.data.datamodule import PackedDataModule
from lightning_v17.models.lightning import LlamaLM


class V17CLI(LightningCLI):
    """LightningCLI over the reference model and the packed stdlib corpus.

    The resolved config is re-saved on every run (``overwrite=True``), so re-running a YAML job or resuming it
    with ``--ckpt_path last`` never fails on an existing ``config.yaml``.
    """


def run_lightning_cli(argv: list[str] | None = None) -> V17CLI:
    """Parse ``argv`` (e.g. ``["fit", "--config", "configs/tiny-cpu.yaml"]``) and run the subcommand."""
    # Arguments equal to the command line are read from it by LightningCLI itself (passing both only warns).
    args = None if argv is None or list(argv) == sys.argv[1:] else argv
    return V17CLI(LlamaLM, PackedDataModule, args=args, save_config_kwargs={"overwrite": True})
