"""The FP8 policy: the scaling recipe, the backend and which Linears stay in high precision, given as
``V17Strategy(fp8=FP8Policy(...))`` (or ``fp8="tensorwise"``, the recipe alone). Torch-free like
:mod:`lightning_v17.config`, which re-exports these names."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from lightning_v17.config.errors import V17ConfigError, parse_enum

if TYPE_CHECKING:
    from lightning_v17.config import ZeroPolicy  # config imports this module

__all__ = ["FP8Backend", "FP8Policy", "FP8Recipe"]


class FP8Recipe(StrEnum):
    """How float8 scales are chosen (Micikevicius 2022, "FP8 Formats for Deep Learning", §3-4; torchao float8 README).

    ``tensorwise``: one dynamic scale per tensor (amax of the whole tensor, computed every step). ``rowwise``: one
    dynamic scale per row/column along the contraction's outer dims, scales rounded to powers of 2 (more accurate,
    slower on H100 per the README). ``delayed``: scales from an amax history of earlier steps (Micikevicius 2022 §4.3;
    Transformer Engine's ``DelayedScaling``); torchao 0.18 removed it (pytorch/ao#1680), so it is ours
    (``lightning_v17/engine/fp8/delayed.py``).
    """

    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    DELAYED = "delayed"


class FP8Backend(StrEnum):
    """Which library runs the float8 matmuls: ``torchao`` (``Float8Linear``, any device, CPU included), ``te``
    (NVIDIA Transformer Engine, GPUs of compute capability >= 8.9), ``auto`` (``te`` when installed and the device
    supports FP8, else ``torchao``; resolved by ``lightning_v17.engine.fp8.convert.resolve_fp8_backend`` for a device)."""

    AUTO = "auto"
    TORCHAO = "torchao"
    TE = "te"


@dataclass(frozen=True)
class FP8Policy:
    """Float8 matmuls in the repeated blocks' ``nn.Linear`` layers (Micikevicius 2022, "FP8 Formats for Deep
    Learning"; ``lightning_v17.engine.fp8.convert``).

    A Linear is converted when it sits inside a block and both its dims divide 16 (16 x tp under tensor
    parallelism); the others are listed in one warning. Embeddings, the output head and norms stay in high
    precision, and so do the master weights and the optimizer. The DeepSpeed JSON config has no FP8 section, so
    this policy comes only from ``V17Strategy(fp8=...)``.

    Args:
        recipe: the scaling recipe (:class:`FP8Recipe`): "tensorwise" (one dynamic scale per tensor; torchao
            ``Float8Linear``), "rowwise" (per-row dynamic scales, powers of 2; torchao) or "delayed" (scales from an
            amax history of earlier steps, synced over the dp and tp axes; lightning-v17's own, since torchao 0.18
            removed it, pytorch/ao#1680). With tp > 1: "tensorwise" (torchao's float8 tensor-parallel styles) or
            "delayed" (plain styles, tp-synced histories).
        backend: "torchao" (any device, CPU included), "te" (NVIDIA Transformer Engine: a GPU of compute
            capability >= 8.9 with transformer-engine installed; its path is not implemented yet, so it raises a
            clear error) or "auto" (torchao in this version; Transformer Engine where it can run once that path
            exists).
        skip: ``fnmatch`` patterns of module FQNs kept in high precision besides the fixed rule (a pattern matching
            a block keeps all its Linears), e.g. ``("*.w2", "model.layers.0")``; a pattern matching no module is an
            error.
        all_gather: ZeRO-3 all-gathers the converted weights in float8 (torchao's ``enable_fsdp_float8_all_gather``:
            a quarter of the fp32 bytes; on gloo the bytes travel as uint8), with their scales computed after each
            optimizer step in one all-reduce. None: on for "tensorwise" at zero_stage=3, else off; False gathers
            them in their own dtype. True with "rowwise" is refused (torchao quantizes a rowwise weight along a
            different dim for each of its GEMMs, so no single float8 copy can be gathered); True below
            zero_stage=3 is refused by the composition check.
        amax_history_len: "delayed" only: how many steps of amax (max abs x) history each float8 scale is
            computed from (scale = float8 max / max of the history). None: 16. The histories are all-reduced with
            MAX over the dp and tp axes after each optimizer step and are saved in checkpoints
            (``engine/fp8/delayed.py``).
    """

    recipe: FP8Recipe | str = "tensorwise"  # plain defaults: the Lightning CLI prints them as written
    backend: FP8Backend | str = "auto"
    skip: tuple[str, ...] = ()
    all_gather: bool | None = None
    amax_history_len: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "recipe", parse_enum(FP8Recipe, self.recipe, option="fp8"))
        object.__setattr__(self, "backend", parse_enum(FP8Backend, self.backend, option="FP8Policy(backend=...)"))
        if isinstance(self.skip, str):
            raise V17ConfigError(f"FP8Policy(skip={self.skip!r}) must be a list of FQN patterns, e.g. [{self.skip!r}]")
        object.__setattr__(self, "skip", tuple(str(s) for s in self.skip))
        if self.amax_history_len is not None:
            if self.recipe != FP8Recipe.DELAYED:
                raise V17ConfigError(
                    f"FP8Policy(amax_history_len={self.amax_history_len}) applies only to the 'delayed' recipe (got "
                    f"{self.recipe.value!r}, whose scales are dynamic); set FP8Policy(recipe='delayed') or drop it"
                )
            if isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int) or (
                self.amax_history_len < 1
            ):
                raise V17ConfigError(
                    f"FP8Policy(amax_history_len={self.amax_history_len!r}) must be a positive integer"
                )
        if self.all_gather and self.recipe != FP8Recipe.TENSORWISE:
            raise V17ConfigError(
                f"FP8Policy(all_gather=True) needs the 'tensorwise' recipe (got {self.recipe.value!r}): torchao "
                "gathers one float8 copy of each weight, and a rowwise weight is quantized along a different dim for "
                "each of its GEMMs; use FP8Policy(recipe='tensorwise'), or all_gather=None/False"
            )

    @property
    def history_len(self) -> int:
        """``delayed``: the amax history length (``amax_history_len``, default 16)."""
        return 16 if self.amax_history_len is None else self.amax_history_len

    def float8_all_gather(self, *, zero: ZeroPolicy) -> bool:
        """Whether ZeRO-3 all-gathers the converted weights in float8 under ``zero`` (see ``all_gather``): only where
        it shards, and so all-gathers, the parameters."""
        if not zero.shards_params:
            return False
        return self.recipe == FP8Recipe.TENSORWISE if self.all_gather is None else bool(self.all_gather)

    @classmethod
    def from_options(
        cls, fp8: Any, backend: Any = "auto", skip: Any = (), all_gather: bool | None = None,
        amax_history_len: int | None = None,
    ) -> FP8Policy | None:  # fmt: skip
        """The policy for the flat spelling ``fp8=, fp8_backend=, fp8_skip=, fp8_all_gather=,
        fp8_amax_history_len=`` (the tests' and benches' shorthand, ``tests/_strategy.py``); None when ``fp8`` is
        None/False.

        Raises:
            V17ConfigError: an unknown recipe or backend, or ``backend``/``skip``/``all_gather``/``amax_history_len``
                without fp8.
        """
        if fp8 is None or fp8 is False:
            backend = parse_enum(FP8Backend, backend, option="FP8Policy(backend=...)")
            unused = [n for n, on in (("backend", backend != FP8Backend.AUTO), ("skip", bool(skip)),
                                      ("all_gather", all_gather is not None),
                                      ("amax_history_len", amax_history_len is not None)) if on]  # fmt: skip
            if unused:
                raise V17ConfigError(f"FP8Policy's {' and '.join(unused)} apply only with a recipe, fp8='tensorwise', "
                                     "'rowwise' or 'delayed'; set fp8 or drop them")  # fmt: skip
            return None
        skip = skip if isinstance(skip, str) else tuple(skip or ())
        return cls(recipe=fp8, backend=backend, skip=skip, all_gather=all_gather, amax_history_len=amax_history_len)
