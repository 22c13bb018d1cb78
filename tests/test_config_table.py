"""Every config key acts or is named ([Note: keys accepted but not acted on] in config/not_acted_on.py).

The test walks every field of every schema section (config/schema.py, config/offload.py, the root in
config/parse.py) and fails for a field that is neither read by the code outside config/ nor a
parsed entry of `not_acted_on.TABLE`.

How a read is found: a static scan (`ast`) of every module of src/zeroshard outside config/. It
infers, for each expression, which schema section classes it may hold:
  * a parameter annotated with a section class (`section: OffloadOptimizerConfig`);
  * a call of a function whose return annotation is a section class (`load_config(...)`);
  * `<x>.config` / a name `config` or `cfg` followed by a field of the root config
    (`engine.config.fp16`, `cfg.zero_optimization`): the root config, by convention;
  * an attribute of an expression known to hold a section, when that attribute is a sub-section
    field (`config.zero_optimization.offload_optimizer`);
  * a local name assigned from any of these (`zero = config.zero_optimization`);
  * a parameter of a function (looked up by name) that some call passes such an expression to,
    positionally or by keyword (`build_placement(zero, config.aio, ...)` types `aio` in
    `build_placement` and, through it, in `_store`), iterated to a fixed point.
A field is read when an attribute of that name is loaded from an expression holding its section
(`zero.stage`, `getattr(aio, "thread_count")`); `.model_dump()` or `getattr(section, <not a
constant>)` reads every field of the section.

Limits (what the scan cannot see, so what a reviewer still checks by hand):
  * a read through a value the inference does not follow (a container, a return value without
    annotation, `**vars(section)`, a lambda's parameter) is missed: the test then fails for a key
    that is in fact read — annotate the parameter or the return type and it is found;
  * functions are matched by name, not by import: two functions of the same name both receive
    the binding, so a field read on an unrelated object of a same-named function's parameter
    counts as read;
  * "read" is not "acted on": a field read only to be passed on unused, or read to warn about it,
    counts as read. The test proves every key is looked at or named; the behaviour tests
    (test_config.py, test_offload.py, ...) prove it acts.
"""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import zeroshard
from zeroshard.config import not_acted_on
from zeroshard.config.base import Section
from zeroshard.config.parse import ZeroShardConfig

SRC = Path(zeroshard.__file__).parent
ROOT = ZeroShardConfig
ROOT_NAMES = {"config", "cfg"}


# ---------------------------------------------------------------------------------------- the schema


def _section_classes(annotation) -> set[type[Section]]:
    """The Section classes an annotation may hold (through Optional, Union, Annotated, list)."""
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return {annotation}
    return {c for arg in typing.get_args(annotation) for c in _section_classes(arg)}


def schema_classes() -> dict[str, type[Section]]:
    """Every section class reachable from the root, by class name."""
    found: dict[str, type[Section]] = {}
    todo = [ROOT]
    while todo:
        cls = todo.pop()
        if cls.__name__ in found:
            continue
        found[cls.__name__] = cls
        for field in cls.model_fields.values():
            todo += sorted(_section_classes(field.annotation), key=lambda c: c.__name__)
    return found


CLASSES = schema_classes()


def key_path(cls: type[Section], name: str) -> str:
    return f"{cls.section_path}.{name}" if cls.section_path else name


def schema_keys() -> list[tuple[type[Section], str]]:
    """(section class, field) for every leaf field (sub-sections are containers, not keys)."""
    keys = []
    for cls in CLASSES.values():
        internal = getattr(cls, "internal_keys", frozenset())
        for name, field in cls.model_fields.items():
            if name not in internal and not _section_classes(field.annotation):
                keys.append((cls, name))
    return keys


# ---------------------------------------------------------------------------------------- the scan


def _annotation_classes(node) -> set[type[Section]]:
    if node is None:
        return set()
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return set()
    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
    return {CLASSES[n] for n in names if n in CLASSES}


class _Function:
    """One function (or a module body) and what its local names may hold."""

    def __init__(self, node, parent: _Function | None, is_method: bool):
        self.node, self.parent = node, parent
        args = node.args if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
        self.params: list[str] = []
        self.env: dict[str, set] = {}
        if args is not None:
            every = [*args.posonlyargs, *args.args]
            self.params = [a.arg for a in every][1 if is_method and every else 0 :]
            for a in [*every, *args.kwonlyargs]:
                if classes := _annotation_classes(a.annotation):
                    self.env[a.arg] = set(classes)
        self.returns = _annotation_classes(getattr(node, "returns", None))

    def lookup(self, name: str) -> set:
        scope = self
        while scope is not None:
            if name in scope.env:
                return scope.env[name]
            scope = scope.parent
        return set()


class Scan:
    """Which (section class, field) pairs the given sources read; see the module docstring."""

    def __init__(self, sources: dict[str, str], signatures: dict[str, str] | None = None):
        self.functions: list[_Function] = []
        self.by_name: dict[str, list[_Function]] = {}
        self.returns: dict[str, set] = {}
        for text in (signatures or {}).values():  # modules whose return annotations count, not their reads
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self.returns.setdefault(node.name, set()).update(_annotation_classes(node.returns))
        self.trees = [ast.parse(text, filename=name) for name, text in sources.items()]
        for tree in self.trees:
            self._collect(tree, None, False)
        for function in self.functions:
            if function.returns:
                self.returns.setdefault(function.node.name, set()).update(function.returns)
        self.reads: set[tuple[type[Section], str]] = set()
        for _ in range(10):  # bindings flow through calls: iterate to a fixed point
            before = sum(len(v) for f in self.functions for v in f.env.values())
            for function in self.functions:
                self._bind(function)
            if sum(len(v) for f in self.functions for v in f.env.values()) == before:
                break
        for function in self.functions:
            self._read(function)

    def _collect(self, node, parent, is_method) -> None:
        function = _Function(node, parent, is_method)
        self.functions.append(function)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            self.by_name.setdefault(node.name, []).append(function)
        for child in self._own_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self._collect(child, function, False)
            elif isinstance(child, ast.ClassDef):
                for item in child.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        self._collect(item, function, True)
                        if item.name == "__init__":  # a call of the class binds __init__'s parameters
                            self.by_name.setdefault(child.name, []).append(self.functions[-1])

    @staticmethod
    def _own_nodes(node):
        """Nodes of this function's body, not of the functions and classes nested in it."""
        todo = list(ast.iter_child_nodes(node))
        while todo:
            child = todo.pop()
            yield child
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                todo += list(ast.iter_child_nodes(child))

    # -- what an expression may hold
    def holds(self, node, function: _Function) -> set:
        if isinstance(node, ast.Name):
            return function.lookup(node.id)
        if isinstance(node, ast.NamedExpr):
            return self.holds(node.value, function)
        if isinstance(node, ast.IfExp):
            return self.holds(node.body, function) | self.holds(node.orelse, function)
        if isinstance(node, ast.BoolOp):
            return set().union(*(self.holds(v, function) for v in node.values))
        if isinstance(node, ast.Call):
            callee = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            return set(self.returns.get(callee, set()))
        if isinstance(node, ast.Attribute):
            return self._attribute_holds(node, function)
        return set()

    def _attribute_holds(self, node: ast.Attribute, function: _Function) -> set:
        base = self.holds(node.value, function)
        if not base and node.attr in ROOT.model_fields and _names_root(node.value):
            base = {ROOT}
        out = set()
        for cls in base:
            if node.attr in cls.model_fields:
                out |= _section_classes(cls.model_fields[node.attr].annotation)
        return out

    # -- bindings
    def _bind(self, function: _Function) -> None:
        for node in self._own_nodes(function.node):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    self._assign(target, node.value, function)
            elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                self._assign(node.target, node.value, function)
            elif isinstance(node, ast.Call):
                self._bind_call(node, function)

    def _assign(self, target, value, function: _Function) -> None:
        if isinstance(target, ast.Name):
            if classes := self.holds(value, function):
                function.env.setdefault(target.id, set()).update(classes)
        elif isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
            for t, v in zip(target.elts, value.elts):
                self._assign(t, v, function)

    def _bind_call(self, node: ast.Call, function: _Function) -> None:
        callee = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
        for target in self.by_name.get(callee, []):
            for index, arg in enumerate(node.args):
                if index < len(target.params) and (classes := self.holds(arg, function)):
                    target.env.setdefault(target.params[index], set()).update(classes)
            for keyword in node.keywords:
                if keyword.arg and (classes := self.holds(keyword.value, function)):
                    target.env.setdefault(keyword.arg, set()).update(classes)

    # -- reads
    def _read(self, function: _Function) -> None:
        for node in self._own_nodes(function.node):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                base = self.holds(node.value, function)
                if not base and node.attr in ROOT.model_fields and _names_root(node.value):
                    base = {ROOT}
                if node.attr == "model_dump":
                    self._read_all(base)
                self.reads |= {(cls, node.attr) for cls in base if node.attr in cls.model_fields}
                self.reads |= {(cls, name) for cls in base for name in _property_reads(cls, node.attr)}
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "getattr"
                and len(node.args) >= 2
            ):
                base = self.holds(node.args[0], function)
                name = node.args[1]
                if isinstance(name, ast.Constant) and isinstance(name.value, str):
                    self.reads |= {(cls, name.value) for cls in base if name.value in cls.model_fields}
                else:
                    self._read_all(base)

    def _read_all(self, classes) -> None:
        for cls in classes:
            for name, field in cls.model_fields.items():
                self.reads.add((cls, name))
                self._read_all(_section_classes(field.annotation))


def _property_reads(cls: type[Section], name: str) -> set[str]:
    """The fields a derived property of a section reads (`torch_autocast.torch_dtype` reads `dtype`)."""
    prop = getattr(cls, name, None)
    if not isinstance(prop, property) or prop.fget is None:
        return set()
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(prop.fget)))
    return {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
        and n.attr in cls.model_fields
    }


def _names_root(node) -> bool:
    """`config` / `cfg`, or `<anything>.config`: the root config by convention."""
    return (isinstance(node, ast.Name) and node.id in ROOT_NAMES) or (
        isinstance(node, ast.Attribute) and node.attr in ROOT_NAMES
    )


def source_scan() -> Scan:
    outside, inside = {}, {}
    for path in sorted(SRC.rglob("*.py")):
        relative = path.relative_to(SRC)
        (inside if relative.parts[0] == "config" else outside)[str(relative)] = path.read_text()
    return Scan(outside, signatures=inside)


# ---------------------------------------------------------------------------------------- the tests


def _unaccounted(scan: Scan) -> list[str]:
    missing = []
    for cls, name in schema_keys():
        path = key_path(cls, name)
        rule = not_acted_on.TABLE.get(path)
        if (cls, name) not in scan.reads and not (rule is not None and rule.parsed):
            missing.append(path)
    return sorted(set(missing))


def test_every_schema_key_is_read_or_in_the_table():
    missing = _unaccounted(source_scan())
    assert not missing, (
        f"config keys neither read by the code outside config/ nor in not_acted_on.TABLE: {missing}; act on "
        "each as DeepSpeed documents, or add it to TABLE with the reason (see the limits of the scan in "
        "this test's docstring)"
    )


def test_the_table_names_only_keys_that_exist():
    """A parsed TABLE entry must be a field of the schema, a leaf or a whole section (a renamed field
    would leave it dead)."""
    keys = {key_path(cls, name) for cls in CLASSES.values() for name in cls.model_fields}
    stale = [path for path, rule in not_acted_on.TABLE.items() if rule.parsed and path not in keys]
    assert not stale, f"parsed entries of not_acted_on.TABLE that are no schema field: {stale}"


def test_scan_follows_sections_through_names_calls_and_annotations():
    sources = {
        "m.py": """
def engine(config, model):
    zero = config.zero_optimization
    placement(zero, config.aio)
    model.config.block_size           # GPT's block_size, not aio.block_size: model.config has no aio
    return zero.stage

def placement(zero, aio):
    store(zero.offload_optimizer, aio)

def store(section, aio):
    return section.device, getattr(aio, "thread_count", 2)

def typed(section: "FP16Config"):
    return section.hysteresis

def dumped(cfg):
    return cfg.scheduler.params.model_dump()
"""
    }
    reads = {key_path(cls, name) for cls, name in Scan(sources).reads}
    for expected in (
        "zero_optimization.stage",
        "zero_optimization.offload_optimizer.device",
        "aio.thread_count",
        "fp16.hysteresis",
        "scheduler.params.warmup_num_steps",
        "scheduler.params.total_num_steps",
        "scheduler.params.cos_min_ratio",
    ):
        assert expected in reads, expected
    for absent in ("aio.block_size", "zero_optimization.offload_param.device", "fp16.enabled"):
        assert absent not in reads, absent


# ------------------------------------------------------------- keys that act, each reported by name


def test_aio_request_knobs_are_reported_once_by_name():
    import warnings

    from zeroshard.config import load_config
    from zeroshard.config.parse import ConfigKeyNotActedOnWarning

    config = {
        "aio": {
            "block_size": 262144,
            "queue_depth": 16,
            "single_submit": True,
            "overlap_events": False,
            "thread_count": 3,
        }
    }
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        load_config(config, 1)
    named = sorted(str(w.message).split("'")[1] for w in record if w.category is ConfigKeyNotActedOnWarning)
    assert named == ["aio.block_size", "aio.overlap_events", "aio.queue_depth", "aio.single_submit"]


def test_aio_thread_count_is_the_number_of_write_back_threads(tmp_path):
    import torch

    from zeroshard.config import load_config
    from zeroshard.offload import build_placement

    for threads in (1, 3):
        cfg = load_config(
            {
                "zero_optimization": {
                    "stage": 2,
                    "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / f"t{threads}")},
                },
                "aio": {"thread_count": threads},
            },
            1,
        )
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(10))])
        store = build_placement(cfg.zero_optimization, cfg.aio, optimizer, 10, 0, 1).optimizer_store
        try:
            assert store.threads == threads and store._pool.count == threads
        finally:
            store.destroy()


def _order_of_reductions(engine) -> list[str]:
    """Run one micro step and return the events 'reduce <unit>' / 'wait <unit>' in order."""
    from tests.checkpoint_helpers import tiny_batches, train_micro_steps

    events = []
    for unit in engine.units:
        for method, word in (("reduce_grads", "reduce"), ("finish_reduce", "wait")):
            original = getattr(unit, method)

            def logged(*args, _original=original, _word=word, _name=unit.name, **kwargs):
                events.append(f"{_word} {_name}")
                return _original(*args, **kwargs)

            setattr(unit, method, logged)  # this engine's units only, inside this test rank
        # A reduction that has already landed is taken at once ([Note: taken as they land]), which on a
        # slow or loaded machine can look like a wait; seen as never landed early, only the policy waits.
        unit.reduction_done = lambda: False
    train_micro_steps(engine, tiny_batches(), 0, 1)
    return events


def _acting_worker(rank: int, world: int, *, root: str) -> dict:
    from pathlib import Path

    from tests.checkpoint_helpers import build_engine, full_params, tiny_batches, train_micro_steps

    out = {}
    params = {}
    for overlap in (False, True):
        engine = build_engine(2, zero={"overlap_comm": overlap})
        events = _order_of_reductions(engine)
        reduces = [i for i, e in enumerate(events) if e.startswith("reduce")]
        # overlap_comm false: each unit's reduction is waited for before the next one is issued (a
        # wait with nothing in flight, before a unit's reduction, is a no-op and proves nothing)
        out[f"serial overlap={overlap}"] = bool(reduces) and all(
            i + 1 < len(events) and events[i + 1] == "wait " + events[i].split(" ", 1)[1] for i in reduces
        )
        train_micro_steps(engine, tiny_batches(), 1, 2)
        params[overlap] = full_params(engine)
        engine.destroy()
    out["same weights"] = all(torch_equal(params[False][k], params[True][k]) for k in params[True])
    for gather in (False, True):
        engine = build_engine(3, zero={"stage3_gather_16bit_weights_on_model_save": gather})
        result = engine.save_16bit_model(f"{root}/g{gather}", "model.safetensors")
        out[f"saved gather={gather}"] = (result, Path(f"{root}/g{gather}/model.safetensors").is_file())
        engine.destroy()
    return out


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def test_overlap_comm_and_16bit_save_do_what_deepspeed_documents(tmp_path):
    from tests.harness import run_distributed

    for report in run_distributed(_acting_worker, 2, timeout=120, root=str(tmp_path)):
        assert report["serial overlap=False"], "overlap_comm false: every reduction waited for before the next"
        assert not report["serial overlap=True"], "overlap_comm true: reductions overlap backward"
        assert report["same weights"], "overlap changes when, not what"
        assert report["saved gather=False"] == (False, False), "DeepSpeed at stage 3: nothing saved, False"
        assert report["saved gather=True"] == (str(tmp_path / "gTrue" / "model.safetensors"), True)
