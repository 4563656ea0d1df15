"""Ops that run eagerly but that ``torch.compile`` cannot trace as extraction recorded them, made compilable.

transformers' mixture-of-experts layers (Qwen3-MoE, Mixtral, ... with ``config._experts_implementation ==
"grouped_mm"``, the default) choose their kernel while they run: in eager mode ``torch._grouped_mm``, which has CPU
kernels for every float dtype; under ``torch.compile`` (``is_torchdynamo_compiling()``) a per-expert loop of matrix
multiplies in a custom op of their own unless the weights are bfloat16, because the fake-tensor (meta) kernel of
``torch._grouped_mm`` accepts bfloat16 only. Extraction runs the model eagerly, so its graphs call
``torch._grouped_mm``; dynamo then fails on them with a ``TorchRuntimeError`` ("Expected inputs of BF16 type")
where ``torch.compile`` of the plain model works.

:func:`compilable_target` swaps such a node's function for :func:`grouped_mm`, which calls ``torch._grouped_mm``
itself in eager mode and when dynamo's fake kernel accepts the dtypes, and otherwise the opaque custom op
``gradpatch::grouped_mm``: dynamo records it as one op with the output shape :func:`_grouped_mm_fake` gives,
and at run time it calls the same ``torch._grouped_mm`` kernel on the same tensors. Compiled graphs thus compute
exactly what the eager graph computes, gradients included (``gradpatch::grouped_mm_backward`` forms the grouped
products autograd forms for ``torch._grouped_mm``). With a bias (which transformers never passes), or bfloat16
operands, the node calls ``torch._grouped_mm`` under dynamo too; should dynamo fail on it there,
:mod:`gradpatch.compiled` runs the patch set eagerly with a warning. The swap keeps the node's name and its operation (``call_function:_grouped_mm``), so NodePaths and
saved patches are unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from .._torch_compat import grouped_mm_functions, grouped_mm_kernel

_SCHEMA = "(Tensor mat_a, Tensor mat_b, Tensor? offs, ScalarType? out_dtype)"


def compilable_target(target: Any) -> Any:
    """The function a ``call_function`` node should call instead of ``target`` so that ``torch.compile`` can trace
    it (:func:`grouped_mm` for a grouped matrix multiply), or ``target`` itself."""
    if callable(target) and any(target is function for function in grouped_mm_functions()):
        return grouped_mm
    return target


def grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch._grouped_mm(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)``; under ``torch.compile``
    with operands other than bfloat16 (which dynamo's fake kernel refuses) and no bias, the same kernel behind the
    opaque custom op ``gradpatch::grouped_mm``.

    Raises:
        whatever ``torch._grouped_mm`` raises for these operands (the same error eagerly and compiled).
    """
    if torch.compiler.is_compiling() and bias is None and not (mat_a.dtype == mat_b.dtype == torch.bfloat16):
        return torch.ops.gradpatch.grouped_mm(mat_a, mat_b, offs, out_dtype)
    return grouped_mm_kernel()(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)


grouped_mm.__name__ = grouped_mm.__qualname__ = "_grouped_mm"  # the node's operation stays the traced one's


@torch.library.custom_op("gradpatch::grouped_mm", mutates_args=(), schema=f"{_SCHEMA} -> Tensor")
def _grouped_mm_op(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None,
                   out_dtype: torch.dtype | None) -> torch.Tensor:
    return grouped_mm_kernel()(mat_a, mat_b, offs=offs, out_dtype=out_dtype).contiguous()


@_grouped_mm_op.register_fake
def _grouped_mm_fake(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None,
                     out_dtype: torch.dtype | None) -> torch.Tensor:
    """The output's shape, as ``torch._grouped_mm``'s meta kernel gives it (contiguous, as the op returns it)."""
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        size = [offs.size(0) if offs is not None else 1, mat_a.size(0), mat_b.size(1)]
    elif mat_a.dim() == 2:
        size = [mat_a.size(0), mat_b.size(-1)]
    elif mat_b.dim() == 2:
        size = [mat_a.size(1), mat_b.size(1)]
    else:
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    return mat_a.new_empty(size, dtype=out_dtype or mat_a.dtype)


@torch.library.custom_op("gradpatch::grouped_mm_backward", mutates_args=(),
                         schema="(Tensor grad, Tensor mat_a, Tensor mat_b, Tensor? offs) -> (Tensor, Tensor)")
def _grouped_mm_backward_op(grad: torch.Tensor, mat_a: torch.Tensor, mat_b: torch.Tensor,
                            offs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``torch._grouped_mm`` for ``mat_a`` and ``mat_b`` at ``grad``, formed as autograd forms them
    (``_grouped_mm_mat1_backward`` and ``_grouped_mm_mat2_backward``: grouped products with the other operand,
    in the layout of the operand differentiated), so they equal the eager graph's."""
    kernel = grouped_mm_kernel()
    grad = grad.contiguous()
    if _column_major(mat_a):
        grad_a = kernel(mat_b, grad.transpose(-2, -1), offs=offs).transpose(-2, -1)
    else:
        grad_a = kernel(grad, mat_b.transpose(-2, -1), offs=offs)
    if _column_major(mat_b):
        grad_b = kernel(grad.transpose(-2, -1), mat_a, offs=offs).transpose(-2, -1)
    else:
        grad_b = kernel(mat_a.transpose(-2, -1), grad, offs=offs)
    return grad_a.contiguous(), grad_b.contiguous()


@_grouped_mm_backward_op.register_fake
def _grouped_mm_backward_fake(grad: torch.Tensor, mat_a: torch.Tensor, mat_b: torch.Tensor,
                              offs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return mat_a.new_empty(mat_a.shape), mat_b.new_empty(mat_b.shape)


def _column_major(matrix: torch.Tensor) -> bool:
    """Whether the last two dimensions of ``matrix`` are stored column by column (a transposed row-major one)."""
    return matrix.stride(-2) == 1 and matrix.stride(-1) >= max(1, matrix.size(-2)) and matrix.size(-1) > 1


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs[:3])


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    mat_a, mat_b, offs = ctx.saved_tensors
    grad_a, grad_b = torch.ops.gradpatch.grouped_mm_backward(grad, mat_a, mat_b, offs)
    return grad_a, grad_b, None, None


_grouped_mm_op.register_autograd(_backward, setup_context=_setup_context)
