"""PyTorch side of the stack benchmark (`bench_stack.py`): the block, the loss,
the seed runtime without its per-block host read, and one step per variant.

* `SdpaGqaBlock`: the seed's reference block
  (`eae_runtime.contrib.PreNormTransformerBlock`: same parameter names and
  layout, RMSNorm, interleaved RoPE, SwiGLU) whose attention calls
  ``F.scaled_dot_product_attention(..., enable_gqa=True)`` instead of
  repeating K and V, and whose RoPE tables are one pair for the whole stack,
  in the compute dtype (the reference keeps float32 tables of ``max_seq_len``
  rows in every block and casts them on every call). The reference's
  attention has no switch for either, hence this block; a test checks that
  both compute the same function from the same weights.
* `half_mse`: ``0.5 * mean((out - y)**2)`` in float32 that keeps only its
  bf16 inputs for the backward, as XLA does for the JAX variants' loss: no
  float32 copy of the target lives beside the model.
* `NoHostReadScheduler`: the seed runtime's sequential reverse loop without
  the one host read it makes per block (see its docstring).
* `make_step`: one forward + backward of a stack for a variant's mode.

Why each choice: docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from eae_runtime import EAERuntime, RuntimeConfig
from eae_runtime.adjoint import AdjointState
from eae_runtime.contrib import RMSNorm, SwiGLU, apply_rotary
from eae_runtime.events import EventType
from eae_runtime.schedulers import BaseScheduler, ReverseContext

#: Attention backends `make_step` can pin, by the name results record.
SDPA_BACKENDS = ("flash", "cudnn", "efficient", "math")

#: Modes of `make_step`: autograd over the stack (``plain``), per-block
#: ``torch.utils.checkpoint`` (``ckpt``), each block compiled with
#: ``torch.compile`` (``compile``; ``compile-ckpt`` compiles each
#: checkpointed block; ``compile-budget`` sets
#: ``torch._functorch.config.activation_memory_budget`` first), and the seed
#: runtime (``eae``, ``eae-nosync``).
MODES = ("plain", "ckpt", "compile", "compile-ckpt", "compile-budget", "eae", "eae-nosync")


def sdpa_backend(name: str):
    """The `torch.nn.attention.SDPBackend` called ``name`` (one of `SDPA_BACKENDS`).

    >>> sdpa_backend("math").name
    'MATH'
    """
    from torch.nn.attention import SDPBackend

    members = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
               "math": "MATH"}
    if name not in members:
        raise ValueError(f"unknown SDPA backend {name!r}; expected one of {SDPA_BACKENDS}")
    return getattr(SDPBackend, members[name])


def pinned_attention(backend: Optional[str]):
    """A context in which SDPA runs only on ``backend`` (None: no constraint).

    >>> with pinned_attention("math"):
    ...     F.scaled_dot_product_attention(*[torch.zeros(1, 1, 2, 4)] * 3).shape
    torch.Size([1, 1, 2, 4])
    """
    if backend is None:
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel([sdpa_backend(backend)])


class RopeTables(nn.Module):
    """cos/sin tables ``(seq_len, head_dim // 2)`` in ``dtype``, computed in
    float32 as the seed's `RotaryPositionalEmbedding` does, rounded once.

    >>> RopeTables(8, 4, torch.float32).cos.shape
    torch.Size([4, 4])
    """

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, seq_len: int, dtype: torch.dtype, base: float = 10000.0, device=None):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
        freqs = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
        self.register_buffer("cos", freqs.cos().to(dtype), persistent=False)
        self.register_buffer("sin", freqs.sin().to(dtype), persistent=False)


class GqaAttention(nn.Module):
    """Causal grouped-query attention through SDPA with ``enable_gqa``.

    Query head ``h`` attends with kv head ``h // (num_heads // num_kv_heads)``,
    the grouping of the reference's ``repeat_interleave``. ``expand_kv``
    repeats the kv heads instead of passing ``enable_gqa``: torch's
    min-cut partitioner under ``activation_memory_budget`` counts SDPA's
    FLOPs with a formula that refuses grouped shapes.
    """

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, rope: RopeTables, expand_kv: bool = False):
        super().__init__()
        if dim % num_heads or num_heads % num_kv_heads:
            raise ValueError(f"bad head layout: dim {dim}, heads {num_heads}, kv heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, dim // num_heads
        self.q_proj = nn.Linear(dim, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, num_kv_heads * self.head_dim, bias=False)
        self.out_proj = nn.Linear(num_heads * self.head_dim, dim, bias=False)
        self.rope = rope
        self.expand_kv = expand_kv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        if seq > self.rope.cos.shape[0]:
            raise ValueError(f"sequence of {seq} tokens is longer than the RoPE tables ({self.rope.cos.shape[0]})")
        hd = self.head_dim
        q = self.q_proj(x).view(batch, seq, self.num_heads, hd).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.num_kv_heads, hd).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, hd).transpose(1, 2)
        cos, sin = self.rope.cos[:seq], self.rope.sin[:seq]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        grouped = self.num_kv_heads != self.num_heads
        if grouped and self.expand_kv:
            rep = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            grouped = False
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)
        return self.out_proj(out.transpose(1, 2).reshape(batch, seq, self.num_heads * hd))


class SdpaGqaBlock(nn.Module):
    """Pre-norm LLaMA-style block with the parameters of the seed's
    `PreNormTransformerBlock` (``load_state_dict`` takes its state dict).

    >>> rope = RopeTables(8, 4, torch.float32)
    >>> blk = SdpaGqaBlock(16, 2, 1, 32, rope)
    >>> blk(torch.zeros(1, 4, 16)).shape
    torch.Size([1, 4, 16])
    """

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, ffn_hidden_dim: int, rope: RopeTables,
                 norm_eps: float = 1e-6, expand_kv: bool = False):
        super().__init__()
        self.attn_norm = RMSNorm(dim, eps=norm_eps)
        self.attn = GqaAttention(dim, num_heads, num_kv_heads, rope, expand_kv=expand_kv)
        self.ffn_norm = RMSNorm(dim, eps=norm_eps)
        self.ffn = SwiGLU(dim, hidden_dim=ffn_hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class _HalfMSE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, y):
        ctx.save_for_backward(out, y)
        d = out.float()
        d.sub_(y)
        return 0.5 * d.square_().mean()

    @staticmethod
    def backward(ctx, g):
        out, y = ctx.saved_tensors
        d = out.float()
        d.sub_(y)
        return d.mul_(g / out.numel()).to(out.dtype), None


def half_mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``0.5 * mean((out - y)**2)`` computed in float32; the backward keeps
    only ``out`` and ``y`` (float32 differences are recomputed, not stored).

    >>> half_mse(torch.tensor([1.0, 3.0]), torch.tensor([0.0, 0.0])).item()
    2.5
    """
    if out.shape != y.shape:
        raise ValueError(f"loss: output {tuple(out.shape)} and target {tuple(y.shape)} differ in shape")
    return _HalfMSE.apply(out, y)


def reconstruct_without_host_read(engine, block: nn.Module, input_activation: torch.Tensor, adjoint: AdjointState,
                                  block_name: str = "") -> Tuple[AdjointState, Dict[nn.Parameter, torch.Tensor]]:
    """The seed's `ReconstructionEngine.reconstruct`, step for step, except
    that its ``BlockReconstructed`` event carries no ``grad_norm``: the seed
    computes that norm with ``.item()`` for every block, whether or not
    anyone listens, which makes the host wait for the device each block."""
    compute_dtype = engine.compute_dtype or input_activation.dtype
    x = input_activation.detach().to(compute_dtype).clone().requires_grad_(True)
    with torch.enable_grad():
        out = block(x)
    params = [p for p in block.parameters() if p.requires_grad]
    grad_outputs = adjoint.tensor.to(device=out.device, dtype=out.dtype)
    if grad_outputs.shape != out.shape:
        raise RuntimeError(f"Adjoint shape {tuple(grad_outputs.shape)} does not match block output shape "
                           f"{tuple(out.shape)} for block '{block_name}'")
    grads = torch.autograd.grad(outputs=out, inputs=[x, *params], grad_outputs=grad_outputs, retain_graph=False,
                                allow_unused=True)
    grad_x = grads[0] if grads[0] is not None else torch.zeros_like(x)
    param_grads = {p: g for p, g in zip(params, grads[1:]) if g is not None}
    new_adjoint = AdjointState(tensor=grad_x.detach(), layer_id=adjoint.layer_id - 1, block=block_name,
                               metadata=dict(adjoint.metadata))
    new_adjoint.record(f"reconstruct:{block_name}")
    engine.event_bus.emit(EventType.BLOCK_RECONSTRUCTED, block=block_name, layer_id=adjoint.layer_id)
    return new_adjoint, param_grads


class NoHostReadScheduler(BaseScheduler):
    """The seed's `SequentialScheduler` with `reconstruct_without_host_read`.

    ``RuntimeConfig`` has no option that drops the seed's per-block
    ``.item()`` (it sits inside `ReconstructionEngine.reconstruct`); its
    documented extension point is a scheduler instance
    (``RuntimeConfig(scheduler=...)``), so this one runs the seed's
    per-block sequence (boundary read, reconstruction, adjoint pipeline,
    memory release, scheduler event, gradient accumulation) with the
    reconstruction written out minus that read. Everything else (forward
    executor, boundary store, memory pool, profiler, events) is the seed's.
    """

    name = "NoHostReadScheduler"

    def run(self, context: ReverseContext) -> Dict[nn.Parameter, torch.Tensor]:
        adjoint = context.initial_adjoint
        param_grads: Dict[nn.Parameter, torch.Tensor] = {}
        for i in reversed(range(len(context.blocks))):
            block, name = context.blocks[i], context.block_names[i]
            input_activation = context.boundary_store.get(i)
            with context.profiler.track(f"reconstruct:{name}"):
                adjoint, updates = reconstruct_without_host_read(context.reconstruction_engine, block,
                                                                 input_activation, adjoint, block_name=name)
            adjoint = context.pipeline.run(adjoint, context={"block_index": i, "block_name": name})
            context.memory_manager.release(input_activation)
            context.event_bus.emit(EventType.SCHEDULER_STEP, block_index=i, block_name=name)
            self._accumulate(param_grads, updates)
        return param_grads


class Checkpointed(nn.Module):
    """``torch.utils.checkpoint`` (non-reentrant) around one block."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


def set_memory_budget(budget: float) -> None:
    """Set ``torch._functorch.config.activation_memory_budget`` (the
    partitioner's activation budget under ``torch.compile``), refusing a torch
    without it or a budget outside [0, 1]."""
    import torch._functorch.config as functorch_config

    if not hasattr(functorch_config, "activation_memory_budget"):
        raise RuntimeError(f"torch {torch.__version__} has no torch._functorch.config.activation_memory_budget")
    if not 0.0 <= float(budget) <= 1.0:
        raise ValueError(f"activation memory budget must lie in [0, 1], got {budget}")
    functorch_config.activation_memory_budget = float(budget)


def make_step(blocks: nn.ModuleList, mode: str, x: torch.Tensor, y: torch.Tensor, backend: Optional[str] = None,
              budget: Optional[float] = None) -> Callable[[], Tuple[torch.Tensor, Optional[dict]]]:
    """One forward + backward of ``blocks`` on ``(x, y)`` under ``mode`` (see `MODES`).

    The returned ``step()`` gives ``(loss, grads)``: ``grads`` maps each
    parameter to its gradient for the seed runtime's modes, and is None where
    the gradients are in ``p.grad``. With ``backend``, every attention call of
    the step (forward, recomputation, backward) is pinned to that SDPA
    backend; a backend that cannot run the call raises instead of falling
    back. ``compile-budget`` sets the process-wide activation budget: give
    each budget its own process (compiled graphs are cached per process).

    >>> rope = RopeTables(8, 4, torch.float32)
    >>> blocks = nn.ModuleList([SdpaGqaBlock(16, 2, 1, 32, rope) for _ in range(2)])
    >>> x = torch.randn(1, 4, 16); y = torch.zeros(1, 4, 16)
    >>> loss, grads = make_step(blocks, "ckpt", x, y, backend="math")()
    >>> grads is None and blocks[0].ffn.up_proj.weight.grad.shape == (32, 16)
    True
    """
    if mode not in MODES:
        raise ValueError(f"unknown torch mode {mode!r}; expected one of {MODES}")
    if (budget is not None) != (mode == "compile-budget"):
        raise ValueError("an activation memory budget goes with mode 'compile-budget' only")
    pin = functools.partial(pinned_attention, backend)
    if mode in ("eae", "eae-nosync"):
        config = RuntimeConfig(scheduler=NoHostReadScheduler()) if mode == "eae-nosync" else RuntimeConfig()
        runtime = EAERuntime(blocks, None, config)

        def eae_step():
            with pin():
                return runtime.compute_gradients(x, lambda out: half_mse(out, y))

        return eae_step
    if mode == "compile-budget":
        set_memory_budget(budget)
    if mode in ("ckpt", "compile-ckpt"):
        layers = [Checkpointed(b) for b in blocks]
    else:
        layers = list(blocks)
    if mode.startswith("compile"):
        import torch._dynamo.config as dynamo_config

        # A recompile past the limit would silently run the block eagerly.
        if hasattr(dynamo_config, "fail_on_recompile_limit_hit"):
            dynamo_config.fail_on_recompile_limit_hit = True
        layers = [torch.compile(layer, fullgraph=True, dynamic=False) for layer in layers]
    params = list(blocks.parameters())

    def step():
        for p in params:
            p.grad = None
        with pin():
            h = x
            for layer in layers:
                h = layer(h)
            loss = half_mse(h, y)
            loss.backward()
        return loss.detach(), None

    return step


def build_blocks(shape: dict, weight, leaves, seq: int, device, dtype, expand_kv: bool = False) -> nn.ModuleList:
    """A stack of `SdpaGqaBlock` sharing one `RopeTables`, loaded block by block.

    ``shape``: dim, heads, kv_heads, ffn, depth; ``weight(our_name, i)``:
    block ``i``'s leaf as a tensor (loaded one at a time, so a deep stack
    never sits twice in memory); ``leaves``: ``(our_name, torch_module_path)``
    pairs (`bench_common.LEAVES`); ``expand_kv``: see `GqaAttention`.
    """
    rope = RopeTables(shape["dim"] // shape["heads"], seq, dtype, device=device)
    blocks = nn.ModuleList()
    with torch.no_grad():
        for i in range(shape["depth"]):
            with torch.device(device):
                blk = SdpaGqaBlock(shape["dim"], shape["heads"], shape["kv_heads"], shape["ffn"], rope,
                                   expand_kv=expand_kv)
            blk = blk.to(dtype)  # the shared tables are already in dtype: .to() keeps them
            for name, path in leaves:
                p = module_param(blk, path)
                src = weight(name, i)
                if tuple(p.shape) != tuple(src.shape):
                    raise ValueError(f"{path}: block parameter {tuple(p.shape)} != weight {tuple(src.shape)}")
                p.copy_(src)
            blocks.append(blk)
    return blocks


def module_param(block: nn.Module, path: str) -> torch.Tensor:
    """The parameter at dotted ``path`` (e.g. ``attn.q_proj.weight``)."""
    obj = block
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj
