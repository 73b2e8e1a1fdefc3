"""How an op is declared: ``Op`` takes the schema, fake and backend table that an op module writes once, and
defines the op for every backend that serves it (docs/dispatch.md).

An op module (``lantern/ops/<op>_op.py``) holds the public function, its argument checks, its schema, its fake
(meta) implementation and its backend table, and builds one ``Op`` from them. ``Op`` then:
- defines ``lantern::<op>`` with the schema when the table names the C++ extension (``EXTENSION``): lantern._C
  only registers the CPU and CUDA kernels of that schema (``LANTERN_KERNEL`` in csrc/cpu, csrc/cuda), when
  ``lantern.ops.extension`` calls ``lantern._C.register_kernels()``;
- defines ``lantern_reference::<op>`` for every op: the PyTorch reference as an opaque custom op, which is what
  torch.compile traces for the reference backend (the reference's Python has value-dependent control flow that a
  graph cannot hold); eager code calls the reference function directly;
- defines ``lantern_triton::<op>`` when the table names a Triton kernel module (``lantern.kernels.<op>``), from
  that module's ``launch`` (schema arguments), once the backend loads: a ``torch.library.triton_op`` on a GPU, so
  inductor sees the kernels (``wrap_triton``), an opaque custom op under Triton's interpreter.
The three namespaces exist because torch needs one operator per implementation kind (a ``triton_op`` is an
operator of its own, and the reference must be opaque to tracing); nobody writes them by hand.

The public ops take Python numbers or tensors for settings and seeds; the schemas take tensors only (a device
tensor can change between CUDA-graph replays). An op's ``to_schema`` converts one to the other, the same way for
every backend (the helpers below), and ``from_schema`` turns the operator's outputs into the public result.
"""
from __future__ import annotations

import importlib
from typing import Callable, Dict, Optional, Sequence, Tuple, Union

import torch

EXTENSION = "lantern._C"  # a backend-table entry: the op's kernel is lantern._C's lantern::<op> (CPU or CUDA)
FUSED_BACKENDS = ("cpu", "cuda", "triton")

IntLike = Union[int, torch.Tensor]
MASK64 = 2**64 - 1

OPS: Dict[str, "Op"] = {}  # op name -> its Op, in declaration order (filled as the op modules import)
_TRITON_DECLARED: set = set()  # ops whose lantern_triton:: operator exists


def _identity_args(backend: str, *args, **kwargs) -> tuple:
    if kwargs:
        raise TypeError(f"unexpected keyword arguments {sorted(kwargs)}")
    return args


def _identity(out):
    return out


class Op:
    """One op for every backend: see the module docstring.

    name: the op's name; schema: its torch.library schema without the name, written once here; fake: the fake
    implementation (schema arguments -> outputs with the right shapes, dtypes and devices); backends: backend ->
    what serves it ("reference": the readable definition with the public signature, always present; "cpu" /
    "cuda": ``EXTENSION``; "triton": the kernel module's name); to_schema(backend, *public args): the schema's
    arguments; from_schema: the public result from the operator's outputs; reference_kernel: the reference with
    the schema's signature (default: the reference itself, for ops whose public signature is the schema's);
    mutates: the arguments written in place."""

    def __init__(self, name: str, schema: str, fake: Callable, *, backends: Dict[str, object],
                 to_schema: Callable = _identity_args, from_schema: Callable = _identity,
                 reference_kernel: Optional[Callable] = None, mutates: Sequence[str] = ()) -> None:
        if not callable(backends.get("reference")):
            raise ValueError(f"{name}: the backend table needs the reference definition")
        self.name, self.schema, self.fake = name, schema, fake
        self.backends = dict(backends)
        self.to_schema, self.from_schema, self.mutates = to_schema, from_schema, tuple(mutates)
        self.reference = backends["reference"]
        self._declare_reference(reference_kernel or self.reference)
        if EXTENSION in (backends.get("cpu"), backends.get("cuda")):
            torch.library.define(f"lantern::{name}", schema)
            torch.library.register_fake(f"lantern::{name}")(fake)
        self._extension_caller = self._caller("extension", lambda: getattr(torch.ops.lantern, name))
        self._triton_caller: Optional[Callable] = None
        OPS[name] = self
        from .. import _backend

        _backend._REGISTRY["reference"][name] = self.reference

    # ---- the implementations, each with the public op's signature ----------------------------------------

    def _caller(self, kind: str, operator: Callable[[], Callable]) -> Callable:
        """A function with the public signature that converts the arguments, counts the kernel call (for
        ``lantern._backend.kernel_calls``) and calls the operator."""
        from .. import _backend

        name, to_schema, from_schema = self.name, self.to_schema, self.from_schema
        backend = "triton" if kind == "triton" else "cpu"  # the conversion rules: C++ kernels or Triton

        def call(*args, **kwargs):
            schema_args = to_schema(backend, *args, **kwargs)
            if kind == "triton":
                _backend.count_kernel("triton", name)
            else:
                device = next((a.device for a in schema_args if isinstance(a, torch.Tensor)), None)
                _backend.count_kernel("cuda" if device is not None and device.type == "cuda" else "cpu", name)
            return from_schema(operator()(*schema_args))

        call.__name__ = call.__qualname__ = f"{name}_{kind}"
        call.__doc__ = f"lantern's {name} through its {kind} kernel (the public signature; see lantern.ops.{name})."
        return call

    def extension_kernels(self, dispatch_key: str) -> Optional[Callable]:
        """The caller of lantern._C's kernel for ``dispatch_key`` ("CPU", "CUDA"), or None when the table names
        none or lantern._C has none (not built, or built without it)."""
        backend = "cuda" if dispatch_key == "CUDA" else "cpu"
        if self.backends.get(backend) != EXTENSION:
            return None
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"lantern::{self.name}", dispatch_key):
            return None
        return self._extension_caller

    @property
    def triton_module(self) -> Optional[str]:
        return self.backends.get("triton")

    def load_triton(self) -> Callable:
        """Import the Triton kernel module, declare ``lantern_triton::<op>`` from its ``launch`` (once per
        process) and return the caller (raises whatever the import or the declaration raises)."""
        if self._triton_caller is None:
            module = importlib.import_module(self.triton_module)
            if self.name not in _TRITON_DECLARED:
                from ..kernels._common import interpreting

                declare_triton(self, module.launch, interpreting())
                _TRITON_DECLARED.add(self.name)
            self._triton_caller = self._caller("triton", lambda: getattr(torch.ops.lantern_triton, self.name))
        return self._triton_caller

    def caller(self, backend: str) -> Callable:
        """The function with the public signature that runs ``backend``'s implementation, without the checks
        and without the dispatcher's choice or self-check (for tests and benchmarks of one kernel)."""
        if backend == "reference":
            return self.reference
        if backend in ("cpu", "cuda") and self.backends.get(backend) == EXTENSION:
            return self._extension_caller
        if backend == "triton" and self.triton_module:
            return self.load_triton()
        raise ValueError(f"{self.name} has no {backend} kernel (its backends: {sorted(self.backends)})")

    # ---- the reference as an operator (what torch.compile traces) -----------------------------------------

    def _declare_reference(self, kernel: Callable) -> None:
        op = torch.library.custom_op(f"lantern_reference::{self.name}", kernel, mutates_args=self.mutates,
                                     schema=self.schema)
        op.register_fake(self.fake)
        name, to_schema, from_schema = self.name, self.to_schema, self.from_schema

        def call(*args, **kwargs):
            return from_schema(getattr(torch.ops.lantern_reference, name)(*to_schema("reference", *args, **kwargs)))

        self.reference_op = call


def declare_triton(op: Op, launch: Callable, interpreting: bool):
    """Declare ``lantern_triton::<op>`` with ``launch`` (schema arguments) as its kernel for every device. On a
    GPU it is a ``triton_op`` (``launch`` calls its kernels through ``torch.library.wrap_triton``, and is traced
    with fake tensors as its own fake implementation); under the interpreter an opaque custom op."""
    qualname = f"lantern_triton::{op.name}"
    if interpreting:
        declared = torch.library.custom_op(qualname, launch, mutates_args=op.mutates, schema=op.schema)
        declared.register_fake(op.fake)
        return declared
    return torch.library.triton_op(qualname, launch, mutates_args=op.mutates, schema=op.schema)


# ---- public arguments -> schema arguments (shared by the op modules) -----------------------------------------

def compute_dtype(logits: torch.Tensor, backend: str) -> torch.dtype:
    """The type a backend computes §1 in: float64 for float64 logits on the C++ kernels and the reference,
    float32 otherwise (the Triton kernels compute in float32)."""
    return torch.float64 if logits.dtype == torch.float64 and backend != "triton" else torch.float32


def seed_tensor(seed: IntLike, device: torch.device) -> torch.Tensor:
    """The seed as the schemas take it: a 0-d int64 tensor on ``device`` holding the seed's 64 bits."""
    if isinstance(seed, torch.Tensor):
        return seed.reshape(()).to(device=device, dtype=torch.int64)
    seed = int(seed) & MASK64
    return torch.tensor(seed - 2**64 if seed >= 2**63 else seed, dtype=torch.int64, device=device)


def offset_tensor(offset: IntLike, device: torch.device) -> torch.Tensor:
    if isinstance(offset, torch.Tensor):
        return offset.reshape(()).to(device=device, dtype=torch.int64)
    return torch.tensor(int(offset) & 0xFFFFFFFF, dtype=torch.int64, device=device)


def unsigned(seed: torch.Tensor) -> int:
    """A schema's seed tensor back to the 64-bit unsigned seed the reference takes."""
    return int(seed) & MASK64


def row_setting(value, B: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A scalar or [B] setting as a contiguous [B] tensor of ``dtype``, converted as the reference does
    (a Python number straight to ``dtype``: 0.9 becomes float64 0.9, not float64(float32(0.9)))."""
    if not isinstance(value, torch.Tensor):  # one allocation (this conversion's cost shows at B = 1)
        return torch.full((B,), value, dtype=dtype, device=device)
    t = value.to(device=device, dtype=dtype)
    return t.expand(B).contiguous() if t.dim() == 0 else t.contiguous()


def setting(value, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A scalar (0-d) or per-row setting as a tensor of ``dtype`` (for ops that broadcast either)."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype)
    return torch.tensor(value, dtype=dtype, device=device)


def ops() -> Tuple[Op, ...]:
    return tuple(OPS.values())
