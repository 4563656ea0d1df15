"""PatchableGraph: a module equivalent to the wrapped model in which every intermediate value is patchable."""

from __future__ import annotations

import contextlib
import copy
import dis
import functools
import inspect
import sys
import warnings
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Sequence, Union

import torch
from torch import nn

from .errors import InputSignatureError, NodePathError, ShapeSpecializationError
from .extraction import Extractor
from .graph_modules import CompiledGraphModule
from .node_path import NodeData, NodeTree
from .options import ExtractionOptions
from .patches import FiniteCheck, Patch, ProbePatch, RecordPatch, check_value_shape
from .patching import PatchTable
from .serialization import FileLike, graph_bytes, read, write
from .values import holds_tensor

PatchSpec = Union[Patch, Sequence[Patch]]
PatchMap = Mapping[Union[str, NodeData], PatchSpec]


class PatchableGraph(nn.Module):
    """Wrap ``module`` so that every intermediate tensor operation is a named, patchable node.

    ``PatchableGraph(module, [options,] *example_args, **example_kwargs)`` (graphpatch's order; options first is
    accepted too) runs ``module`` once on the example inputs and extracts a graph per submodule call (see
    :mod:`gradpatch.extraction`). Calling the PatchableGraph runs those graphs: outside a :meth:`patch` block it
    returns what ``module`` returns (same values, same gradients), on inputs of other batch sizes and sequence
    lengths too. Parameters are shared with ``module``. Arguments that held tensors in the example are graph
    inputs; the others (``use_cache=False``, say) are fixed by the example.

    Args:
        module: the model, any ``nn.Module`` (transformers models included; pass ``use_cache=False``).
        options: optional :class:`ExtractionOptions`.
        example_args, example_kwargs: one valid call of ``module``.

    Attributes:
        config, generation_config: copies of a transformers model's (``None`` for other modules, or with
            ``ExtractionOptions(copy_transformers_generation_config=False)``); :meth:`generate` uses
            ``generation_config``.

    Raises:
        ExtractionError: with ``error_on_compilation_failure=True``, for a module whose graph cannot be extracted.
        TypeError: ``module`` is not an ``nn.Module``.
    """

    def __init__(self, *args: Any, **example_kwargs: Any) -> None:
        super().__init__()
        options, module, example_args = _split_arguments(args)
        object.__setattr__(self, "_original", module)
        self._options = options
        self._example = (tuple(example_args), dict(example_kwargs))
        self._signature = inspect.signature(module.forward)
        self._example_call = self._signature.bind(*example_args, **example_kwargs).arguments
        self._example_inputs = {name for name, value in self._example_call.items() if holds_tensor(value)}
        self._ignored_keywords = unread_var_keyword(type(module).forward)
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        self._positional_names = [p.name for p in self._signature.parameters.values() if p.kind in positional]
        self._variants: dict[tuple[bool, tuple | None], nn.Module] = {}  # (training, size class or None: any)
        self._trees: dict[int, NodeTree] = {}
        self._active: list[list[tuple[str, Patch, str]]] = []
        self._patched_owners: set[nn.Module] = set()
        self._checked_calls: set[tuple] = set()
        self.training = module.training
        self._graph_module = self._variant(module.training, self._example)
        copy_config = options.copy_transformers_generation_config
        self.config = copy.deepcopy(getattr(module, "config", None)) if copy_config else None
        self.generation_config = copy.deepcopy(getattr(module, "generation_config", None)) if copy_config else None

    # --- extraction ----------------------------------------------------------------------------------------

    def _variant(self, training: bool, example: tuple[tuple, dict]) -> nn.Module:
        """The graphs for this training mode and the size class of ``example`` (extracted on first use).

        Model code branches on sizes (``if batch_size != position_ids.shape[0]``, ``if q_len > 1``), and a graph
        holds the branch its example took. Graphs are therefore kept per size class: each input dimension counted
        as 1 or as larger, as torch.compile does. A guard in each graph still raises
        :class:`~gradpatch.errors.ShapeSpecializationError` if a call breaks a decision within its class.
        """
        size_free = self._variants.get((training, None))
        if size_free is not None:
            return size_free
        key = (training, self._size_class(*example))
        if key not in self._variants:
            if any(mode == training for mode, _ in self._variants):
                warnings.warn(f"gradpatch: extracting graphs for input sizes {key[1]} (the model's code branches "
                              f"on sizes; once per class of sizes, each dimension 1 or larger)", stacklevel=4)
                example = self._with_example_constants(*example)
            wrapper, guarded = self._extract(training, example)
            self._variants[key if guarded else (training, None)] = wrapper
            return wrapper
        return self._variants[key]

    def _extract(self, training: bool, example: tuple[tuple, dict]) -> tuple[nn.Module, bool]:
        """Extract all graphs on ``example``; returns the root wrapper and whether any graph holds a size guard."""
        extractor = Extractor(self._options)
        module = self._original
        was_training = module.training
        module.train(training)
        saved = {name: buffer.detach().clone() for name, buffer in module.named_buffers()}
        try:
            with torch.enable_grad(), _transformers_extraction():
                wrapper, _ = extractor.extract(module, example[0], example[1], "")
            postprocess = self._options.postprocessing_function
            if postprocess is not None:
                postprocess(wrapper, module)
                for graph_module in wrapper.modules():
                    if isinstance(graph_module, CompiledGraphModule):
                        graph_module.recompile()
        finally:
            with torch.no_grad():
                for name, buffer in module.named_buffers():
                    buffer.copy_(saved[name])
            module.train(was_training)
        return wrapper, extractor.guard_count > 0

    def _with_example_constants(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A call completed with the example's non-tensor arguments (``use_cache=False``) that it leaves out."""
        call = self._signature.bind(*args, **kwargs).arguments
        kwargs = dict(kwargs)
        for name, value in self._example_call.items():
            if name not in call and not isinstance(value, torch.Tensor):
                kwargs[name] = value
        return args, kwargs

    def _apply(self, fn: Any, recurse: bool = True) -> "PatchableGraph":
        """``.to(device)``, ``.half()``, ``.cuda()``…: convert the wrapped model and the example inputs, then
        extract the graphs again (buffers are new tensors after a conversion, and graphs hold device constants)."""
        before = _tensor_identities(self._original)
        self._original._apply(fn, recurse)
        if _tensor_identities(self._original) == before:  # e.g. .to("cpu") on a CPU model: nothing to redo
            return self
        args, kwargs = self._example
        self._example = (tuple(_convert(fn, value) for value in args),
                         {name: _convert(fn, value) for name, value in kwargs.items()})
        self._variants.clear()
        self._trees.clear()
        self._patched_owners = set()
        self._graph_module = self._variant(self.training, self._example)
        self._install_patches()
        return self

    def _size_class(self, args: tuple, kwargs: dict) -> tuple:
        """Each tensor argument, by name, with its dimensions counted as 1 or as larger."""
        named = [*zip(self._positional_names, args), *kwargs.items()]
        return tuple(sorted((name, tuple(min(size, 2) for size in value.shape))
                            for name, value in named if isinstance(value, torch.Tensor)))

    def train(self, mode: bool = True) -> "PatchableGraph":
        """Set training mode everywhere: the wrapped model and every wrapper.

        Graphs bake in ``self.training`` branches (dropout, for one), so the first call in a mode extracts the
        graphs for that mode once; active patches carry over.
        """
        self.training = mode
        self._original.train(mode)
        self._use(self._variant(mode, self._example))
        return self

    def _use(self, wrapper: nn.Module) -> None:
        if wrapper is not self._graph_module:
            for owner in self._patched_owners:
                owner.set_patch_table({})
            self._patched_owners = set()
            self._graph_module = wrapper
            self._install_patches()
        if wrapper.training != self.training:
            wrapper.train(self.training)

    # --- saving --------------------------------------------------------------------------------------------

    def save(self, file: FileLike, weights: bool = True) -> None:
        """Save this graph without pickle: one safetensors file holding the example inputs, the model's weights
        (``weights=True``) and, as JSON metadata, the model's class and fingerprint and the extraction options.
        A path is written atomically (temporary file, then rename). See :meth:`load`.

        Raises:
            ValueError: an example input that is not a tensor, a JSON value or a container of those; or weights
                that are not in memory (use ``weights=False`` for a model dispatched with offload).
        """
        write(file, graph_bytes(self._original, self._options, self._example, weights))

    @classmethod
    def load(cls, file: FileLike, model: nn.Module, options: ExtractionOptions | None = None,
             check_fingerprint: bool = True) -> "PatchableGraph":
        """Rebuild a graph saved by :meth:`save` around ``model``, a model of the saved class (code is never
        stored; build it the usual way, e.g. ``AutoModelForCausalLM.from_config(config)``). Saved weights are
        loaded into it; the graphs are extracted again from the saved example inputs.

        Args:
            file: a path or an open binary file.
            model: the model to wrap (of the class recorded in the file).
            options: required when the graph was built with custom extraction or postprocessing functions.
            check_fingerprint: refuse a model whose weights differ from the saved model's.

        Raises:
            ValueError: not a gradpatch graph file, another model class, a fingerprint mismatch, or custom
                functions without ``options``.
        """
        options, args, kwargs = read(file, model, options, check_fingerprint)
        return cls(model, options, *args, **kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise ValueError("a PatchableGraph is not pickled (pickle runs arbitrary code when loaded): use "
                         "pg.save(path) and PatchableGraph.load(path, model), which write safetensors + JSON")

    # --- calling -------------------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        call_kind = (tuple(_kind(value) for value in args), tuple((name, _kind(value)) for name, value in kwargs.items()))
        if call_kind not in self._checked_calls:
            self._check_call(args, kwargs)
            self._checked_calls.add(call_kind)
        self._use(self._variant(self.training, (args, kwargs)))
        return self._graph_module(*args, **kwargs)

    def _check_call(self, args: tuple, kwargs: dict) -> None:
        """Raise InputSignatureError for a call whose arguments differ in kind from the example's (checked once per
        kind of call: which arguments, tensors or which constant objects). Keyword arguments that only a
        ``**kwargs`` the forward never reads would take are ignored, as the module itself ignores them."""
        inputs = self._example_inputs
        call = self._signature.bind(*args, **kwargs).arguments
        if self._ignored_keywords is not None and self._ignored_keywords in call:
            call = dict(call)
            call.pop(self._ignored_keywords)
        for name, value in call.items():
            if name in inputs:
                continue
            example = self._example_call.get(name, inspect.Parameter.empty)
            if isinstance(value, torch.Tensor) or not _same_constant(value, example):
                shown = "not given" if example is inspect.Parameter.empty else f"{example!r}"
                raise InputSignatureError(
                    f"argument '{name}' differs in kind from the example inputs ({shown}); the graph was extracted "
                    f"without it as an input: build PatchableGraph(model, ..., {name}=...) with an example of it"
                )
        missing = inputs - set(call)
        if missing:
            raise InputSignatureError(
                f"missing argument(s) {sorted(missing)}: they held tensors in the example inputs, so the graph "
                f"takes them as inputs; pass them"
            )

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """``transformers`` generation running this graph, so active patches apply at every step.

        Takes the arguments of the wrapped model's ``generate``; ``use_cache`` is forced to ``False`` (each step
        runs the graph on the whole sequence). Arguments that the graph does not take as inputs are dropped when
        they hold their default meaning (an all-ones ``attention_mask``, a ``cache_position``). Without a
        ``generation_config`` argument, :attr:`generation_config` is used.

        Raises:
            TypeError: the wrapped model has no ``generate`` method.
            InputSignatureError: ``generate`` passes a padding ``attention_mask`` the graph was not built with.
        """
        original = self._original
        if not hasattr(original, "generate"):
            raise TypeError(f"{type(original).__name__} has no generate(); it is not a transformers generation model")
        kwargs["use_cache"] = False
        if self.generation_config is not None:
            kwargs.setdefault("generation_config", self.generation_config)
        graph_forward = self._generation_forward()
        original.forward = graph_forward
        try:
            return original.generate(*args, **kwargs)
        finally:
            del original.forward

    def _generation_forward(self) -> Any:
        inputs = self._example_inputs
        signature = self._signature

        @functools.wraps(type(self._original).forward)
        def forward(*args: Any, **kwargs: Any) -> Any:
            call = signature.bind(*args, **kwargs).arguments
            passed = {name: value for name, value in call.items() if name in inputs}
            mask = call.get("attention_mask")
            if "attention_mask" not in inputs and isinstance(mask, torch.Tensor) and not bool(mask.all()):
                raise InputSignatureError(
                    "generate() passes a padding attention_mask, but the graph was built without one: build "
                    "PatchableGraph(model, input_ids, attention_mask=mask, use_cache=False)"
                )
            return self(**passed)

        forward.__signature__ = signature  # type: ignore[attr-defined]
        return forward

    # --- NodePaths and patching ----------------------------------------------------------------------------

    @property
    def graph(self) -> NodeData:
        """The navigable NodePath tree (see :class:`~gradpatch.node_path.NodeData`) of the example's graphs."""
        return self._tree.root

    def _tree_of(self, wrapper: nn.Module) -> NodeTree:
        if id(wrapper) not in self._trees:
            self._trees[id(wrapper)] = NodeTree(wrapper)
        return self._trees[id(wrapper)]

    @property
    def _tree(self) -> NodeTree:
        return self._tree_of(self._variant(self.training, self._example))

    @property
    def wrapped_model(self) -> nn.Module:
        """The model this graph wraps (its parameters are the graph's)."""
        return self._original

    def node(self, path: str | NodeData) -> NodeData:
        """The node of :attr:`graph` at NodePath ``path`` (``pg.node("model.layers_0.mlp.down_proj.output")``).

        Raises:
            NodePathError: no such node (a KeyError; the message lists the closest valid NodePaths).
        """
        return self._tree.find(_path_string(path))

    def original_module(self, path: str | NodeData) -> nn.Module:
        """The original submodule behind the graph node at NodePath ``path`` (e.g. ``"model.layers_5.mlp"``).

        Raises:
            KeyError: unknown NodePath (the message lists the closest valid ones).
            ValueError: the path names a leaf, not a submodule's graph.
        """
        node = self._tree.find(_path_string(path))
        if not node._is_graph:
            raise ValueError(f"NodePath '{path}' is a leaf; name a submodule's graph, e.g. its parent")
        return node._gp_module.original_module  # type: ignore[union-attr]

    @contextmanager
    def patch(self, patch_map: PatchMap | Any, check_finite: bool = False) -> Iterator["PatchableGraph"]:
        """Apply patches while the block runs: ``with pg.patch({"lm_head.output": ZeroPatch()}): pg(x)``.

        Everything is checked when the block is entered, before any forward pass: the NodePaths, the patch types,
        and the shapes of tensor values where the node's shape is known (a weight's whole shape, an activation's
        last dimension).

        Args:
            patch_map: NodePath (string or ``pg.graph`` node) -> patch or list of patches (applied in order);
                or an :class:`~gradpatch.intervention.Intervention`. Blocks nest; inner patches apply after outer.
            check_finite: after the patches at each node, raise :class:`~gradpatch.errors.NonFiniteError` naming
                the first node whose patched value holds NaN or ±inf (one check per patched node and call).

        Raises:
            NodePathError: (a ``KeyError`` and a ``ValueError``) an unknown NodePath (the message lists the closest
                valid ones), or one naming a graph, a container value without a ``|sub_i`` dig, or an input that
                extraction baked into the graph as a constant.
            PatchShapeError: a tensor value that cannot broadcast to the node's value.
            ValueError: a value that is not a Patch, or a patch map that is not a mapping.
        """
        if hasattr(patch_map, "patch_map"):
            patch_map = patch_map.patch_map()
        entries = self._validate(patch_map)
        if check_finite:
            checked: dict[str, str] = {}
            for path, _, operation in entries:
                checked.setdefault(path, operation)
            entries += [(path, FiniteCheck(path=path), operation) for path, operation in checked.items()]
        self._active.append(entries)
        try:
            self._install_patches()
            yield self
        finally:
            self._active.remove(entries)
            self._install_patches()

    def _validate(self, patch_map: PatchMap) -> list[tuple[str, Patch, str]]:
        """Check a patch map against the current graphs; returns ``(NodePath, patch, node operation)`` entries."""
        if not isinstance(patch_map, Mapping):
            raise ValueError(f"patch() takes a mapping NodePath -> patch(es), got {type(patch_map).__name__}")
        tree = self._tree_of(self._graph_module)
        entries = []
        for key, spec in patch_map.items():
            path = _path_string(key)
            node = tree.find(path)
            if node._is_graph:
                raise NodePathError(
                    f"NodePath '{path}' names a graph, not a value; patch one of its nodes, e.g. '{path}.output'"
                )
            info = node._gp_info
            if info is not None and info.items and info.shape is None:
                first = next(iter(node._gp_children.values()))
                raise NodePathError(f"NodePath '{path}' holds a {info.kind}; dig into it, e.g. '{first._path}'")
            if node._gp_constant:
                raise NodePathError(
                    f"NodePath '{path}' is an input that held no tensor in the example call, so extraction baked "
                    f"its value into the graph; patch the nodes that use it, or build the PatchableGraph with "
                    f"ExtractionOptions(classes_to_skip_compiling={{...}}) for that module to patch it as an input"
                )
            patches = [spec] if isinstance(spec, Patch) else list(spec) if isinstance(spec, (list, tuple)) else [spec]
            for patch in patches:
                if not isinstance(patch, Patch):
                    raise ValueError(f"value for NodePath '{path}' must be a Patch or a list of Patches, "
                                     f"got {type(patch).__name__}")
                check_value_shape(path, patch, node._gp_info, node._gp_op)
                if node._gp_read_only and not isinstance(patch, (ProbePatch, RecordPatch)):
                    raise NodePathError(
                        f"NodePath '{path}': {node._gp_read_only}, which only ProbePatch/RecordPatch may read; "
                        f"patch the layer's input or output instead (an edit applies as a patch on the output: "
                        f"edit.apply(pg, mode='patch'))")
                entries.append((path, patch, node._gp_op))
        return entries

    def _install_patches(self) -> None:
        tree = self._tree_of(self._graph_module)
        tables: dict[nn.Module, PatchTable] = {}
        for entries in self._active:
            for path, patch, operation in entries:
                node = tree.find(path)
                if node._gp_op != operation:
                    raise ShapeSpecializationError(
                        f"NodePath '{path}' is '{operation}' in the graphs the patch was checked against but "
                        f"'{node._gp_op}' in the graphs for this call's sizes; patch a module input, output or weight"
                    )
                tables.setdefault(node._gp_owner, {}).setdefault(node._gp_key, []).append((node._gp_dig, patch))
        for owner in self._patched_owners - set(tables):
            owner.set_patch_table({})
        for owner, table in tables.items():
            owner.set_patch_table(table)
        self._patched_owners = set(tables)


def _transformers_extraction() -> Any:
    """transformers' eager mask decisions during extraction (see :mod:`gradpatch.optional.transformers`), when the
    model's code may use them (transformers is imported); importing it otherwise would cost seconds."""
    if "transformers.masking_utils" not in sys.modules:
        return contextlib.nullcontext()
    from .optional.transformers import eager_mask_decisions

    return eager_mask_decisions()


def _split_arguments(args: tuple) -> tuple[ExtractionOptions, nn.Module, list[Any]]:
    """``(options, module, example args)`` from ``(module, [options,] *args)`` or ``(options, module, *args)``."""
    options = ExtractionOptions()
    rest = list(args)
    if rest and isinstance(rest[0], ExtractionOptions):
        options = rest.pop(0)
    if not rest or not isinstance(rest[0], nn.Module):
        given = type(rest[0]).__name__ if rest else "nothing"
        raise TypeError(f"PatchableGraph wraps an nn.Module: PatchableGraph(model, *example_inputs), got {given}")
    module = rest.pop(0)
    if rest and isinstance(rest[0], ExtractionOptions):
        options = rest.pop(0)
    return options, module, rest


def _convert(fn: Any, value: Any) -> Any:
    """Apply a module conversion function (which leaves integer tensors' dtype alone) to an example input."""
    return fn(value) if isinstance(value, torch.Tensor) else value


def _kind(value: Any) -> Any:
    """What must stay the same between two calls for one argument check to cover both."""
    if isinstance(value, torch.Tensor):
        return torch.Tensor
    if value is None or isinstance(value, (bool, int, float, str)):
        return (type(value), value)
    return object()  # other objects: never equal, so checked on every call


def _tensor_identities(module: nn.Module) -> list[tuple[int, int, torch.dtype, torch.device]]:
    """Which tensors a module's parameters and buffers are (object, storage, dtype, device)."""
    tensors = [*module.parameters(), *module.buffers()]
    return [(id(t), t.data_ptr(), t.dtype, t.device) for t in tensors]


def _same_constant(value: Any, example: Any) -> bool:
    if value is example:
        return True
    try:
        return bool(value == example)
    except Exception:  # objects without a usable equality are compared by identity only
        return False


def _path_string(path: str | NodeData) -> str:
    return path._path if isinstance(path, NodeData) else str(path)


def unread_var_keyword(function: Any) -> str | None:
    """The name of ``function``'s ``**kwargs`` parameter if its code never reads it, else ``None``.

    A keyword argument that only such a parameter would take has no effect on the call.
    """
    code = getattr(function, "__code__", None)
    if code is None or not code.co_flags & inspect.CO_VARKEYWORDS:
        return None
    name = code.co_varnames[code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & inspect.CO_VARARGS)]
    if name in code.co_cellvars:
        return None
    read = any(instruction.argval == name for instruction in dis.get_instructions(code)
               if instruction.opname.startswith("LOAD_"))
    return None if read else name
