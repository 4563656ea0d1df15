"""PatchableGraph: a module equivalent to the wrapped model in which every intermediate value is patchable."""

from __future__ import annotations

import copy
import sys
import warnings
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Sequence, Union

import torch
from torch import nn

from . import generation
from .extraction.attributes import pretrained_base
from .compiled import CompiledCalls, patch_set_key
from .errors import NodePathError, ShapeSpecializationError
from .extraction.node_path import NodeData, NodeTree
from .extraction.options import ExtractionOptions
from .patches import FiniteCheck, Patch, ProbePatch, RecordPatch, check_value_shape
from .patch_table import PatchTable
from .files.serialization import FileLike, graph_bytes, read, write
from .extraction.variants import GraphVariants

PatchSpec = Union[Patch, Sequence[Patch]]
PatchMap = Mapping[Union[str, NodeData], PatchSpec]

#: The oldest transformers release the test suite passes on (pyproject.toml's ``hf`` extra).
MIN_TRANSFORMERS = "5.12"


def warn_if_old_transformers(module: nn.Module) -> None:
    """Warn (``UserWarning``) when ``module`` is a transformers model and the installed transformers is older than
    :data:`MIN_TRANSFORMERS`: on older releases graphs can compute other outputs than the model (on 4.57, a graph
    extracted with an all-ones ``attention_mask`` gets a padded mask wrong). The message names the fix."""
    if pretrained_base(module) is None:
        return
    from packaging.version import Version  # a transformers dependency

    transformers = sys.modules["transformers"]
    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        warnings.warn(f"gradpatch is tested with transformers >= {MIN_TRANSFORMERS}, and {transformers.__version__} "
                      f"is installed: its graphs can compute other outputs than the model (on 4.57, a padded "
                      f"attention_mask after an all-ones example); pip install 'transformers>={MIN_TRANSFORMERS}'",
                      UserWarning, stacklevel=3)


class PatchableGraph(nn.Module):
    """Wrap ``module`` so that every intermediate tensor operation is a named, patchable node.

    ``PatchableGraph(module, [options,] *example_args, **example_kwargs)`` (graphpatch's order; options first is
    accepted too) runs ``module`` once on the example inputs and extracts a graph per submodule call (see
    :mod:`gradpatch.extraction.extractor`). Calling the PatchableGraph runs those graphs: outside a :meth:`patch` block
    it returns what ``module`` returns (same values, same gradients), on inputs of other batch sizes and sequence
    lengths too. Parameters are shared with ``module``. Arguments that hold tensors (or a KV cache) are graph
    inputs; the others (``use_cache=False``, say) are constants of the graph, and a call that leaves one out uses
    the example's. A call of another kind — other inputs, other constants, another class of sizes — gets graphs of
    its own, extracted once (:mod:`gradpatch.extraction.variants`); ``pg.graph`` draws the example's.

    Args:
        module: the model, any ``nn.Module`` (transformers models included; pass ``use_cache=False`` for plain
            forward passes).
        options: optional :class:`ExtractionOptions`.
        example_args, example_kwargs: one valid call of ``module``.

    Attributes:
        config, generation_config: copies of a transformers model's (``None`` for other modules, or with
            ``ExtractionOptions(copy_transformers_generation_config=False)``); :meth:`generate` uses
            ``generation_config``. A model without ``GenerationMixin`` gets the generation settings of its config
            (:func:`gradpatch.generation.default_generation_config`).

    Raises:
        ExtractionError: with ``error_on_compilation_failure=True``, for a module whose graph cannot be extracted.
        InputSignatureError: the example does not fit ``module.forward``.
        TypeError: ``module`` is not an ``nn.Module``.
    """

    def __init__(self, *args: Any, **example_kwargs: Any) -> None:
        super().__init__()
        options, module, example_args = _split_arguments(args)
        warn_if_old_transformers(module)
        object.__setattr__(self, "_original", module)
        self._options = options
        self._variants = GraphVariants(module, options, (tuple(example_args), dict(example_kwargs)))
        self._trees: dict[int, NodeTree] = {}
        self._active: list[list[tuple[str, Patch, str]]] = []
        self._patched_owners: set[nn.Module] = set()
        self._quiet = False  # no extraction warning (inside generate, where new kinds of call are expected)
        self._compiled: CompiledCalls | None = None
        self.training = module.training
        self._graph_module = self._variants.example_wrapper(module.training)
        copy_config = options.copy_transformers_generation_config
        self.config = copy.deepcopy(getattr(module, "config", None)) if copy_config else None
        self.generation_config = generation.default_generation_config(module) if copy_config else None

    # --- calling -------------------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # traced by torch.compile(pg): the graphs the last eager call chose
            self._variants.check_traced_call(self._graph_module, args, kwargs)
            return self._graph_module(*args, **kwargs)
        self._use(self._variants.for_call(self.training, args, kwargs, warn=not self._quiet))
        if self._compiled is not None:
            return self._compiled.run(patch_set_key(self._active), self._graph_module, args, kwargs)
        return self._graph_module(*args, **kwargs)

    def prepare(self, *args: Any, **kwargs: Any) -> None:
        """Extract now, without a warning or a run, the graphs of calls like this one (per training mode, kind of
        call and class of sizes, :mod:`gradpatch.extraction.variants`), e.g. ``pg.prepare(ids.expand(2, -1))`` before
        a batched pass: a class of sizes counts each dimension as 1 or larger, so a small example stands for a batch.

        Raises:
            InputSignatureError: the arguments do not fit the model's ``forward``.
            ExtractionError: see :class:`~gradpatch.extraction.extractor.Extractor`.
        """
        self._variants.for_call(self.training, args, kwargs, warn=False)

    def compile(self, **compile_kwargs: Any) -> None:  # type: ignore[override]
        """Run every later call of this graph compiled by ``torch.compile(**compile_kwargs)``, patches included
        (:mod:`gradpatch.compiled`): ``pg.compile(); with pg.patch({...}): pg(ids)``.

        Outputs, probes and gradients are those of the eager graph under every patch set. The graphs of each call
        are chosen outside the compiled region (so calls of every kind compile); each patch set (NodePaths, patch
        kinds, slices) compiles once and is reused when it comes back; patch values are graph inputs, so new or
        updated values never recompile. Like ``nn.Module.compile``, it compiles in place and returns ``None``.
        Plain ``torch.compile(pg)`` also respects patches, but runs the graphs of the last eager call's kind.

        Args:
            compile_kwargs: ``torch.compile``'s keyword arguments (``backend``, ``mode``, ``fullgraph``,
                ``dynamic``, ``options``).
        """
        self._compiled = CompiledCalls(compile_kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """transformers generation running this graph with the model's KV cache, so active patches apply at the
        prompt and at every new token (:mod:`gradpatch.generation`).

        Takes the arguments of the wrapped model's ``generate``: ``use_cache=False`` recomputes the whole sequence
        at every step instead; ``cache_implementation="static"`` asks for a static cache. Without a
        ``generation_config`` argument, :attr:`generation_config` is used.

        Raises:
            TypeError: the wrapped model has no ``generate`` method and is not a transformers ``PreTrainedModel``
                (one without ``GenerationMixin`` generates through :func:`gradpatch.generation.generation_view`).
            PatchShapeError: a patch value does not fit a step's value (the message names the step).
        """
        quiet, self._quiet = self._quiet, True
        try:
            return generation.generate(self, self._original, self.generation_config, args, kwargs)
        finally:
            self._quiet = quiet

    def train(self, mode: bool = True) -> "PatchableGraph":
        """Set training mode everywhere: the wrapped model and every wrapper.

        Graphs bake in ``self.training`` branches (dropout, for one), so the first call in a mode extracts the
        graphs for that mode once; active patches carry over.
        """
        self.training = mode
        self._original.train(mode)
        self._use(self._variants.example_wrapper(mode))
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

    def _apply(self, fn: Any, recurse: bool = True) -> "PatchableGraph":
        """``.to(device)``, ``.half()``, ``.cuda()``…: convert the wrapped model and the example inputs, then
        extract the graphs again (buffers are new tensors after a conversion, and graphs hold device constants)."""
        before = _tensor_identities(self._original)
        self._original._apply(fn, recurse)
        if _tensor_identities(self._original) == before:  # e.g. .to("cpu") on a CPU model: nothing to redo
            return self
        self._variants.convert(fn)
        self._trees.clear()
        self._patched_owners = set()
        self._graph_module = self._variants.example_wrapper(self.training)
        self._install_patches()
        return self

    # --- saving --------------------------------------------------------------------------------------------

    def save(self, file: FileLike, weights: bool = True) -> None:
        """Save this graph without pickle: one safetensors file holding the example inputs, the model's weights
        (``weights=True``) and, as JSON metadata, the model's class and fingerprint and the extraction options.
        A path is written atomically (temporary file, then rename). See :meth:`load`.

        Raises:
            ValueError: an example input that is not a tensor, a JSON value or a container of those; or weights
                that are not in memory (use ``weights=False`` for a model dispatched with offload).
        """
        write(file, graph_bytes(self._original, self._options, self._variants.example, weights))

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

    # --- NodePaths -----------------------------------------------------------------------------------------

    @property
    def graph(self) -> NodeData:
        """The navigable NodePath tree (see :class:`~gradpatch.extraction.NodeData`) of the example's graphs."""
        return self._tree.root

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

    def node_paths(self) -> list[str]:
        """Every NodePath of :attr:`graph`, depth first (graphs, values and digs into containers)."""
        return self._tree.all_paths()

    def draw(self, path: str | NodeData = "", depth: int | None = None) -> str:
        """The tree below NodePath ``path`` (the whole graph by default), drawn as ``repr(pg.graph)`` draws it, down
        to ``depth`` levels below that node (all levels when ``None``).

        Raises:
            NodePathError: unknown NodePath (the message lists the closest valid ones).
        """
        return self.node(path)._tree(depth)

    def original_module(self, path: str | NodeData) -> nn.Module:
        """The original submodule behind the graph node at NodePath ``path`` (e.g. ``"model.layers_5.mlp"``).

        Raises:
            NodePathError: unknown NodePath (the message lists the closest valid ones).
            ValueError: the path names a leaf, not a submodule's graph.
        """
        node = self.node(path)
        if not node._is_graph:
            raise ValueError(f"NodePath '{path}' is a leaf; name a submodule's graph, e.g. its parent")
        return node._gp_module.original_module  # type: ignore[union-attr]

    @property
    def _tree(self) -> NodeTree:
        return self._tree_of(self._variants.example_wrapper(self.training))

    @torch.compiler.disable
    def _tree_of(self, wrapper: nn.Module) -> NodeTree:
        if id(wrapper) not in self._trees:
            self._trees[id(wrapper)] = NodeTree(wrapper)
        return self._trees[id(wrapper)]

    # --- patching ------------------------------------------------------------------------------------------

    @contextmanager
    def patch(self, patch_map: PatchMap | Any, check_finite: bool = False) -> Iterator["PatchableGraph"]:
        """Apply patches while the block runs: ``with pg.patch({"lm_head.output": ZeroPatch()}): pg(x)``.

        Everything is checked when the block is entered, before any forward pass: the NodePaths, the patch types,
        and the shapes of tensor values where the node's shape is known (a weight's whole shape, an activation's
        last dimension).

        Args:
            patch_map: NodePath (string or ``pg.graph`` node) -> patch or list of patches (applied in order);
                or an :class:`~gradpatch.interventions.Intervention`. Blocks nest; inner patches apply after outer.
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
        finally:  # by identity: == would compare the patches' fields (a probe's tensors) with other blocks'
            del self._active[next(i for i, active in enumerate(self._active) if active is entries)]
            self._install_patches()

    def _validate(self, patch_map: PatchMap) -> list[tuple[str, Patch, str]]:
        """Check a patch map against the example's graphs; returns ``(NodePath, patch, node operation)`` entries."""
        if not isinstance(patch_map, Mapping):
            raise ValueError(f"patch() takes a mapping NodePath -> patch(es), got {type(patch_map).__name__}")
        tree = self._tree
        entries = []
        for key, spec in patch_map.items():
            path = _path_string(key)
            node = tree.find(path)
            _check_patchable(path, node)
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
                        f"'{node._gp_op}' in the graphs for this kind of call; patch a module input, output, "
                        f"weight or a node named after a variable")
                tables.setdefault(node._gp_owner, {}).setdefault(node._gp_key, []).append((node._gp_dig, patch))
        for owner in self._patched_owners - set(tables):
            owner.set_patch_table({})
        for owner, table in tables.items():
            owner.set_patch_table(table)
        self._patched_owners = set(tables)


def _check_patchable(path: str, node: NodeData) -> None:
    """Raise :class:`NodePathError` unless the node holds a value a patch can change."""
    if node._is_graph:
        raise NodePathError(f"NodePath '{path}' names a graph, not a value; patch one of its nodes, e.g. "
                            f"'{path}.output'")
    info = node._gp_info
    if info is not None and info.items and info.shape is None:
        first = next(iter(node._gp_children.values()))
        raise NodePathError(f"NodePath '{path}' holds a {info.kind}; dig into it, e.g. '{first._path}'")
    if node._gp_constant:
        raise NodePathError(
            f"NodePath '{path}' is an input that held no tensor in the example call, so extraction baked its value "
            f"into the graph; patch the nodes that use it, or build the PatchableGraph with "
            f"ExtractionOptions(classes_to_skip_compiling={{...}}) for that module to patch it as an input")


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


def _tensor_identities(module: nn.Module) -> list[tuple[int, int, torch.dtype, torch.device]]:
    """Which tensors a module's parameters and buffers are (object, storage, dtype, device)."""
    tensors = [*module.parameters(), *module.buffers()]
    return [(id(t), t.data_ptr(), t.dtype, t.device) for t in tensors]


def _path_string(path: str | NodeData) -> str:
    return path._path if isinstance(path, NodeData) else str(path)
