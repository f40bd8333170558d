"""Tiled MLP and tiled logits + loss (``lightning_v17/models/tiled.py``) against the untiled path, on CPU, fp32.

* **Parity.** Same weights, same packed batch (documents, labels -100, a float ``loss_mask``), chunk sizes that do
  not divide the 74 tokens: the loss and count of ``LlamaLM.loss`` with ``loss_chunk_tokens`` / ``mlp_chunk_tokens``
  equal the untiled ``next_token_loss`` path, and every gradient (``output.weight``, ``w1``/``w2``/``w3``, the
  rest) within 1e-6 of it (relative to the tensor's largest entry, or to 1 when that is smaller), under recompute
  none, full and selective. The functions alone: the gradient of the hidden states and of the head; of the MLP
  input and its weights. One chunk (chunk >= tokens) is bitwise the untiled path. The same parity with activation
  offload's hooks on the blocks (nvme tier, full and selective recompute).
* **Memory, saved tensors.** ``saved_tensors_hooks`` over the MLP's forward: untiled autograd keeps four
  ``[tokens, ffn]`` intermediates; tiled it keeps the input alone (the checkpoint's input saver), nothing else.
* **Memory, live bytes.** A ``TorchDispatchMode`` that adds every new float storage an op creates and subtracts it
  when the storage is freed (a weakref finalizer on the storage object, which torch keeps unique per storage, so a
  tensor autograd holds in C++ still counts): the peak over forward + backward. The tiled MLP's peak is ~1/chunks
  of the untiled one; the tiled loss never has more vocab-wide elements alive than one chunk's share of the untiled
  path's (chunk / tokens of it), i.e. one chunk of logits and their gradients at a time.
* **Hooks fire once.** A post-accumulate-grad hook (ZeRO-1/2's bucketing uses them) fires once per backward per
  parameter, tiled or not.
* **Refusals.** Bad chunk sizes, pp > 1 with ``loss_chunk_tokens``, an MLP that changes a chunk's shape (tp's
  sequence parallel, exercised for real in ``tests/dist/test_tiled_zero3.py``), a model without a head.
"""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_v17.config import V17ConfigError
from lightning_v17.engine.recompute import apply_activation_checkpointing
from lightning_v17.models import ModelConfig
from lightning_v17.models.lightning import LlamaLM, next_token_loss
from lightning_v17.models.llama import FeedForward
from lightning_v17.models.tiled import head_detached, tiled_mlp, tiled_next_token_loss

TOL = 1e-6
SHAPE = {"vocab_size": 96, "hidden": 32, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 80, "max_seq_len": 64}
DOCS = ([10, 15, 12], [20, 17])  # two packed rows of 37 tokens: 74 tokens, divisible by neither 7 nor 11


def _batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 37), generator=g)
    pos = torch.cat([torch.cat([torch.arange(n) for n in row]).unsqueeze(0) for row in DOCS])
    labels = torch.roll(ids, -1, dims=1)
    labels[pos.roll(-1, dims=1) == 0] = -100  # a document's last token has no next token inside it
    labels[:, -1] = -100
    mask = torch.rand(2, 37, generator=g)
    mask[0, :6] = 0.0  # an SFT prompt
    return {"input_ids": ids, "position_ids": pos, "labels": labels, "loss_mask": mask}


def _lm(mlp_chunk: int = 0, loss_chunk: int = 0, recompute: str = "none") -> LlamaLM:
    lm = LlamaLM(model="tiny", model_overrides={**SHAPE, "mlp_chunk_tokens": mlp_chunk}, loss_chunk_tokens=loss_chunk)
    lm.configure_model()
    apply_activation_checkpointing(lm.model, mode=recompute, units=lm.model.recompute_units())
    return lm


def _run(lm: LlamaLM, batch: dict) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    loss, count = lm.loss(batch)
    loss.backward()
    return loss.detach(), count, {n: p.grad.clone() for n, p in lm.model.named_parameters()}


def _maxdiff(a: dict, b: dict) -> float:
    """Largest |a - b| over all tensors, each relative to max(1, its reference's largest entry)."""
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) / max(1.0, float(b[k].abs().max())) for k in a)


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
@pytest.mark.parametrize(("mlp_chunk", "loss_chunk"), [(7, 0), (0, 11), (7, 11)])
def test_llama_lm_tiled_equals_untiled(recompute, mlp_chunk, loss_chunk):
    batch = _batch()
    ref_loss, ref_count, ref_grads = _run(_lm(recompute=recompute), batch)
    loss, count, grads = _run(_lm(mlp_chunk, loss_chunk, recompute), batch)
    assert torch.equal(count, ref_count)
    assert float((loss - ref_loss).abs()) <= TOL * max(1.0, float(ref_loss)), (float(loss), float(ref_loss))
    diff = _maxdiff(grads, ref_grads)
    print(f"recompute={recompute} mlp={mlp_chunk} loss={loss_chunk}: loss diff {float(loss - ref_loss):.2e}, "
          f"max grad diff {diff:.2e}")  # fmt: skip
    assert diff <= TOL, diff
    for name in ("output.weight", "layers.0.feed_forward.w1.weight", "layers.1.feed_forward.w2.weight"):
        assert grads[name].abs().max() > 1e-4, name  # a gradient that is really there, not two zeros compared


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_tiled_with_activation_offload_equals_untiled(tmp_path, recompute):
    """The blocks' saved tensors through activation offload's hooks (the nvme tier; its "cpu" tier needs CUDA)."""
    from lightning_v17.engine.offload.activations import ActivationOffload

    batch = _batch(3)
    ref_loss, _, ref_grads = _run(_lm(recompute=recompute), batch)
    lm = _lm(7, 11, recompute)
    with ActivationOffload(lm.model.recompute_units(), tier="nvme", nvme_path=tmp_path, min_bytes=0) as off:
        loss, _, grads = _run(lm, batch)
        assert off.stats["tensors_offloaded"] > 0, off.stats
    assert float((loss - ref_loss).abs()) <= TOL * max(1.0, float(ref_loss))
    assert _maxdiff(grads, ref_grads) <= TOL


def test_one_chunk_is_bitwise_the_untiled_path():
    batch = _batch(1)
    ref = _run(_lm(), batch)
    got = _run(_lm(mlp_chunk=74, loss_chunk=1000), batch)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert all(torch.equal(got[2][k], ref[2][k]) for k in ref[2])


def test_tiled_loss_alone_hidden_and_head_gradients():
    torch.manual_seed(0)
    head = nn.Linear(32, 96, bias=False)
    b = _batch(2)
    hidden = torch.randn(2, 37, 32, requires_grad=True)
    # the independent reference: plain torch, written out here
    logits = head(hidden).reshape(-1, 96)
    per_token = F.cross_entropy(logits, b["labels"].reshape(-1), ignore_index=-100, reduction="none")
    w = (b["labels"].reshape(-1) != -100).float() * b["loss_mask"].reshape(-1)
    ref = (per_token * w).sum() / w.sum()
    ref.backward()
    ref_h, ref_w = hidden.grad.clone(), head.weight.grad.clone()
    assert torch.allclose(next_token_loss(head(hidden), b["labels"], b["loss_mask"])[0], ref, atol=1e-7)
    hidden.grad = head.weight.grad = None
    for chunk in (1, 5, 11, 73, 74, 500):
        loss, count = tiled_next_token_loss(hidden, head, b["labels"], b["loss_mask"], chunk_tokens=chunk)
        loss.backward()
        assert float(count) == pytest.approx(float(w.sum()), abs=0)
        diff = _maxdiff({"loss": loss.detach(), "h": hidden.grad, "w": head.weight.grad},
                        {"loss": ref.detach(), "h": ref_h, "w": ref_w})  # fmt: skip
        print(f"loss alone, chunk {chunk}: max relative diff (loss, hidden grad, head grad) {diff:.2e}")
        assert diff <= TOL, chunk
        hidden.grad = head.weight.grad = None
    with torch.no_grad():  # eval: no checkpoint, the same value
        loss, _ = tiled_next_token_loss(hidden, head, b["labels"], b["loss_mask"], chunk_tokens=9)
    assert float((loss - ref.detach()).abs()) <= TOL



def test_tiled_loss_without_mask_and_all_ignored():
    head = nn.Linear(8, 16, bias=False)
    hidden = torch.randn(1, 10, 8, requires_grad=True)
    labels = torch.full((1, 10), -100)
    loss, count = tiled_next_token_loss(hidden, head, labels, chunk_tokens=3)
    ref, ref_count = next_token_loss(head(hidden), labels)
    assert float(count) == float(ref_count) == 0.0 and float(loss.detach()) == float(ref.detach()) == 0.0
    labels[0, ::2] = 3
    loss, count = tiled_next_token_loss(hidden, head, labels, chunk_tokens=3)
    ref, ref_count = next_token_loss(head(hidden), labels)
    assert float(count) == float(ref_count) == 5.0 and float((loss - ref).detach().abs()) <= TOL


def _ff(chunk: int, ffn: int = 80, hidden: int = 32) -> FeedForward:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=8, hidden=hidden, layers=1, heads=1, kv_heads=1, ffn=ffn, max_seq_len=8,
                      mlp_chunk_tokens=chunk)  # fmt: skip
    return FeedForward(cfg)


def test_tiled_mlp_alone_input_and_weight_gradients():
    ref_ff = _ff(0)
    x = torch.randn(3, 25, 32, requires_grad=True)
    g = torch.randn(3, 25, 32)
    ref_ff(x).backward(g)
    ref = {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in ref_ff.named_parameters()}}
    for chunk in (1, 7, 74, 75, 1000):
        ff = _ff(chunk)
        x.grad = None
        y = ff(x)
        assert y.shape == x.shape
        y.backward(g)
        got = {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in ff.named_parameters()}}
        diff = _maxdiff(got, ref)
        print(f"MLP alone, chunk {chunk}: max relative grad diff {diff:.2e}")
        assert diff <= TOL, chunk
    with torch.no_grad():
        assert float((_ff(7)(x) - ref_ff(x)).abs().max()) <= TOL


# ------------------------------------------------------------------------------------------------------- memory
class LiveBytes(TorchDispatchMode):
    """Live bytes of the float storages created by ops inside the mode, and their peak.

    Each new storage is added once (keyed by its Python object, which torch keeps unique per storage) and
    subtracted by a weakref finalizer when the storage is freed, whoever held it (a Python tensor, or autograd's
    saved variables in C++). ``vocab`` counts the elements of the storages first seen in a tensor whose last dim is
    ``vocab`` (logits, log-probabilities and their gradients).
    """

    def __init__(self, vocab: int = -1) -> None:
        super().__init__()
        self.vocab_dim = vocab
        self.live = self.peak = self.vocab = self.vocab_peak = 0
        self._seen: dict[int, weakref.finalize] = {}

    def _free(self, key: int, nbytes: int, vocab_elems: int) -> None:
        self.live -= nbytes
        self.vocab -= vocab_elems
        self._seen.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                continue
            st = t.untyped_storage()
            if id(st) in self._seen:
                continue
            n = st.nbytes()
            v = n // t.element_size() if t.dim() >= 2 and t.shape[-1] == self.vocab_dim else 0
            self._seen[id(st)] = weakref.finalize(st, self._free, id(st), n, v)
            self.live += n
            self.vocab += v
            self.peak = max(self.peak, self.live)
            self.vocab_peak = max(self.vocab_peak, self.vocab)
        return out


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves while ``fn`` runs (parameters excluded)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(storages.values()), out


TOKENS, FFN, CHUNK = 4096, 1024, 512  # the [tokens, ffn] intermediates dominate: 16 MiB each in fp32


def test_tiled_mlp_keeps_only_its_input_between_forward_and_backward():
    x = torch.randn(TOKENS, 16, requires_grad=True)
    inter = TOKENS * FFN * 4
    untiled, _ = _saved_bytes(lambda: _ff(0, FFN, 16)(x))
    tiled, y = _saved_bytes(lambda: _ff(CHUNK, FFN, 16)(x))
    print(f"saved by autograd: untiled {untiled / 2**20:.2f} MiB, tiled {tiled / 2**20:.3f} MiB "
          f"(input {x.nbytes / 2**20:.3f} MiB)")  # fmt: skip
    assert untiled >= 4 * inter + x.nbytes  # w1 x, silu(w1 x), w3 x, their product (+ the input)
    assert tiled == x.nbytes  # the chunks' checkpoints keep views of the input, nothing else
    y.sum().backward()  # and it still differentiates


def test_tiled_mlp_peak_is_one_chunk_of_intermediates():
    x = torch.randn(TOKENS, 16, requires_grad=True)
    peaks = {}
    for chunk in (0, CHUNK):
        ff = _ff(chunk, FFN, 16)
        with LiveBytes() as mode:
            ff(x).sum().backward()
        peaks[chunk] = mode.peak
    chunks = TOKENS // CHUNK
    ratio = peaks[CHUNK] / peaks[0]
    print(f"MLP fwd+bwd peak: untiled {peaks[0] / 2**20:.2f} MiB, tiled {peaks[CHUNK] / 2**20:.2f} MiB "
          f"(ratio {ratio:.3f}, 1/chunks = {1 / chunks:.3f})")  # fmt: skip
    assert peaks[0] >= 4 * TOKENS * FFN * 4
    assert peaks[CHUNK] <= peaks[0] / chunks * 1.25, ratio


def test_tiled_mlp_in_a_recomputed_block_lowers_the_backward_peak():
    shape = {**SHAPE, "hidden": 16, "heads": 2, "kv_heads": 1, "ffn": FFN, "layers": 1}
    peaks = {}
    for chunk in (0, 256):
        lm = LlamaLM(model="tiny", model_overrides={**shape, "mlp_chunk_tokens": chunk})
        lm.configure_model()
        apply_activation_checkpointing(lm.model, mode="full", units=lm.model.recompute_units())
        block = lm.model.layers["0"]
        h = torch.randn(1, 2048, 16, requires_grad=True)
        pos = torch.arange(2048).unsqueeze(0)
        with LiveBytes() as mode:
            block(h, pos).sum().backward()
        peaks[chunk] = mode.peak
    print(f"full-recompute block peak: untiled MLP {peaks[0] / 2**20:.2f} MiB, tiled {peaks[256] / 2**20:.2f} MiB")
    assert peaks[256] < 0.4 * peaks[0]  # the MLP's 2048 x 1024 intermediates dominate the untiled block


def test_tiled_loss_holds_one_chunk_of_logits_at_a_time():
    vocab, tokens, chunk = 4096, 2048, 256
    torch.manual_seed(0)
    head = nn.Linear(16, vocab, bias=False)
    hidden = torch.randn(1, tokens, 16, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))
    labels[0, ::7] = -100
    peaks = {}
    for c in (0, chunk):
        with LiveBytes(vocab) as mode:
            if c:
                loss, _ = tiled_next_token_loss(hidden, head, labels, chunk_tokens=c)
            else:
                loss, _ = next_token_loss(head(hidden), labels)
            loss.backward()
        peaks[c] = (mode.vocab_peak, mode.peak)
    (vu, pu), (vt, pt) = peaks[0], peaks[chunk]
    print(f"vocab-wide elements alive at peak: untiled {vu} ({vu // (tokens * vocab)} x tokens x vocab), tiled {vt} "
          f"({vt / (chunk * vocab):.2f} x chunk x vocab); live-bytes peak {pu / 2**20:.1f} -> {pt / 2**20:.1f} MiB")
    # Both paths also hold the head's weight gradient, computed as [h, vocab] (h^T @ dlogits) before its transpose.
    grad = 16 * vocab
    assert vu - grad >= 2 * tokens * vocab  # the logits and their log-softmax (or gradient) at once
    assert (vt - grad) * tokens <= (vu - grad) * chunk  # never more than one chunk's share of the untiled path's
    assert vt - grad >= chunk * vocab  # and it is really measured: one chunk of logits exists
    assert pt <= pu / (tokens // chunk) * 1.25


def test_each_parameter_accumulates_its_gradient_once():
    lm = _lm(mlp_chunk=7, loss_chunk=11)
    calls: dict[str, int] = {}
    for name in ("output.weight", "layers.0.feed_forward.w1.weight", "layers.1.feed_forward.w3.weight"):
        p = lm.model.get_parameter(name)
        p.register_post_accumulate_grad_hook(lambda _p, n=name: calls.__setitem__(n, calls.get(n, 0) + 1))
    lm.loss(_batch())[0].backward()
    assert calls == dict.fromkeys(calls, 1) and len(calls) == 3, calls


# ---------------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_bad_chunk_sizes_are_refused(bad):
    with pytest.raises(V17ConfigError, match="loss_chunk_tokens"):
        LlamaLM(loss_chunk_tokens=bad)
    with pytest.raises(V17ConfigError, match="mlp_chunk_tokens"):
        ModelConfig.from_preset("tiny", mlp_chunk_tokens=bad)


class _Mesh:
    """The two members of a DeviceMesh that ``LlamaLM.configure_model`` reads (names, and an axis's size)."""

    mesh_dim_names = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

    def __init__(self, pp: int) -> None:
        self.pp = pp

    def __getitem__(self, name: str):
        return type("Axis", (), {"size": lambda _s: self.pp if name == "pp" else 1})()


def test_loss_chunks_with_pipeline_parallel_are_refused():
    lm = LlamaLM(loss_chunk_tokens=64)
    lm._device_mesh = _Mesh(pp=2)
    with pytest.raises(V17ConfigError, match=r"loss_chunk_tokens=64 with pp=2 .*loss_chunk_tokens=0"):
        lm.configure_model()
    lm._device_mesh = _Mesh(pp=1)
    lm.configure_model()
    assert lm.model is not None


def test_an_mlp_that_changes_a_chunk_shape_is_refused():
    w = torch.randn(8, 4)
    with pytest.raises(V17ConfigError, match="sequence_parallel"):
        tiled_mlp(lambda t: t @ w, torch.randn(10, 8, requires_grad=True), chunk_tokens=3)


def test_head_detached_restores_the_head_and_refuses_a_headless_model():
    lm = _lm()
    head = lm.model.output
    with head_detached(lm.model) as h:
        assert h is head and lm.model.output is None
        out = lm.model(_batch()["input_ids"])
    assert out.shape == (2, 37, SHAPE["hidden"]) and lm.model.output is head
    names = [n for n, _ in lm.model.named_parameters()]
    assert "output.weight" in names
    headless = copy.deepcopy(lm.model)
    headless.output = None
    with pytest.raises(V17ConfigError, match="loss_chunk_tokens=0"), head_detached(headless):
        pass
