"""The reference pages' generated parts, built from the code so that they cannot drift from it.

An MkDocs hook (``hooks:`` in ``mkdocs.yml``): each line ``<!-- generated: NAME -->`` of a page is replaced by
the Markdown of ``GENERATORS[NAME]`` before the page is rendered, so that the pages' prose stays hand-written
and their tables come from the code: every configuration key from the config schemas in Hydra's ConfigStore,
``report.json`` from its typed record, the hooks grouped as ``hookspecs.py`` groups them, the command line's
config groups and exit codes. The same file is a griffe extension (:class:`SphinxRoles`) that turns the
docstrings' Sphinx roles (``:class:`~x.Y```) into code spans for mkdocstrings.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.resources
import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import griffe
from mkdocs.plugins import get_plugin_logger
from omegaconf import MISSING, OmegaConf

log = get_plugin_logger(__name__)

GENERATED = re.compile(r"^<!-- generated: (\w+) -->$", re.MULTILINE)
REPOSITORY_LINK = re.compile(r"\[([^\]]+)\]\((\.\./[^)#\s]*)(#[^)\s]*)?\)")
ROLE = re.compile(r":(?:class|func|meth|attr|data|mod|exc|obj):`~?([^`]+)`")
HYDRA_KEYS = {
    "_target_": "the import path of what Hydra builds",
    "_partial_": "Hydra passes the function itself, its arguments bound later",
}
"""Hydra's own keys, the same in every schema."""


def on_page_markdown(markdown: str, page: Any, config: Any, **_: Any) -> str:
    """The MkDocs hook: replace each ``<!-- generated: NAME -->`` line of a page with NAME's Markdown, and each
    link to a file of the repository outside ``docs/`` as :func:`repository_links` says."""

    def generate(match: re.Match) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            raise KeyError(f"{page.file.src_path} asks for <!-- generated: {name} -->; the generators are "
                           f"{', '.join(GENERATORS)} (docs/gen_reference.py).")
        return GENERATORS[name]()

    return repository_links(GENERATED.sub(generate, markdown), page, config)


def repository_links(markdown: str, page: Any, config: Any) -> str:
    """The page's links to files of the repository outside ``docs/`` (``../elastic_trainer/_trainer.py``), which
    the site does not hold: each is checked to exist (a warning, which fails a strict build, if it does not) and
    becomes a link to the file in ``repo_url`` where one is set, else its text alone."""
    docs_dir = Path(config.docs_dir).resolve()
    root = docs_dir.parent
    page_dir = (docs_dir / page.file.src_path).parent

    def rewrite(match: re.Match) -> str:
        text, target, fragment = match.group(1), match.group(2), match.group(3) or ""
        path = (page_dir / target).resolve()
        if path.is_relative_to(docs_dir) or not path.is_relative_to(root):
            return match.group(0)
        if not path.exists():
            log.warning(f"Doc file '{page.file.src_path}' links to '{target}', which is not in the repository.")
            return match.group(0)
        if not config.repo_url:
            return text
        kind = "tree" if path.is_dir() else "blob"
        return f"[{text}]({config.repo_url.rstrip('/')}/{kind}/HEAD/{path.relative_to(root).as_posix()}{fragment})"

    return REPOSITORY_LINK.sub(rewrite, markdown)


class SphinxRoles(griffe.Extension):
    """A griffe extension: the docstrings' Sphinx roles (``:class:`~elastic_trainer.Trainer```) as code spans
    (```Trainer```), which mkdocstrings' Markdown would otherwise show as written."""

    def on_instance(self, *, obj: griffe.Object, **_: Any) -> None:
        """Rewrite ``obj``'s docstring, if it has one."""
        if obj.docstring is not None:
            obj.docstring.value = plain_roles(obj.docstring.value)


def plain_roles(text: str) -> str:
    """``text`` with each Sphinx role as a code span of its target (its last part after ``~``), and a line's
    closing ``::`` (reST's "a literal block follows", which Markdown's indented block is already) as ``:``."""
    text = ROLE.sub(lambda m: f"`{m.group(1).rsplit('.', 1)[-1] if m.group(0).count('~') else m.group(1)}`", text)
    return re.sub(r"(?<=\w)::$", ":", text, flags=re.MULTILINE)


# -- descriptions of a dataclass's fields ---------------------------------------------------------------------


@functools.cache
def _static_module(name: str) -> griffe.Module | None:
    """The module ``name`` as griffe reads its source (attribute docstrings), or ``None`` if it has none."""
    try:
        return griffe.load(name, resolve_aliases=False)
    except (ImportError, griffe.LoadingError):
        return None


def _attribute_docstrings(cls: type) -> dict[str, str]:
    """The docstrings written under ``cls``'s fields in its source (``x: int = 0`` then ``\"\"\"...\"\"\"``)."""
    module = _static_module(cls.__module__)
    try:
        found = module[cls.__qualname__] if module is not None else None
    except KeyError:  # made at run time (dataclasses.make_dataclass): not in the source
        return {}
    return {name: member.docstring.value for name, member in found.members.items()
            if member.is_attribute and member.docstring is not None}


def _param_docstrings(cls: type) -> dict[str, str]:
    """The ``:param name:`` fields of ``cls``'s docstring and of its ``__init__``'s."""
    params = {}
    for documented in (cls, cls.__init__):
        if documented.__doc__:
            docstring = griffe.Docstring(inspect.cleandoc(documented.__doc__))
            for section in docstring.parse("sphinx", warnings=False):
                if section.kind is griffe.DocstringSectionKind.parameters:
                    # the first paragraph: griffe runs a description on into the paragraphs after the last
                    params |= {param.name: param.description.split("\n\n")[0] for param in section.value}
    return params


def field_descriptions(cls: type) -> dict[str, str]:
    """Each field's description: its ``metadata["help"]``, else the docstring written under it in the source,
    else the ``:param`` of the class's docstring (or of the class a schema is ``built_from``), base classes
    included."""
    descriptions: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            for source in (getattr(klass, "built_from", None), klass):
                if source is not None:
                    descriptions |= _param_docstrings(source) | _attribute_docstrings(source)
    for field in dataclasses.fields(cls):
        if "help" in field.metadata:
            descriptions[field.name] = field.metadata["help"]
    return {name: " ".join(plain_roles(text).split()) for name, text in descriptions.items()}


def type_name(hint: Any) -> str:
    """A type as a reader writes it: ``int | None``, ``list[ScheduledFailureConfig]``, ``Any``."""
    if hint is type(None):
        return "None"
    if isinstance(hint, type) and not typing.get_args(hint):
        return hint.__name__
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return " | ".join(type_name(arg) for arg in typing.get_args(hint))
    return re.sub(r"\b(?:[A-Za-z_]\w*\.)+(\w+)", r"\1", str(hint))


def _dataclass_in(hint: Any) -> tuple[type | None, str]:
    """The dataclass a field holds and how: itself (``""``), or a list or tuple of them (``"[]"``)."""
    args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint, ""
    if typing.get_origin(hint) in (list, tuple) and args and dataclasses.is_dataclass(args[0]):
        return args[0], "[]"
    if (isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union) and len(args) == 1:
        return _dataclass_in(args[0])
    return None, ""


@dataclasses.dataclass(frozen=True)
class Row:
    """One key of a reference table."""

    key: str
    type: str
    default: str
    description: str


def rows_of(cls: type, prefix: str = "", *, defaults: bool = True) -> list[Row]:
    """A row for each field of the dataclass ``cls`` under ``prefix``, in field order; a nested dataclass (or a
    list of them, ``key[].field``) as its own fields' rows after the row of the field that holds it."""
    hints, descriptions = typing.get_type_hints(cls), field_descriptions(cls)
    rows = []
    for field in dataclasses.fields(cls):
        key, hint = f"{prefix}{field.name}", hints[field.name]
        nested, how = _dataclass_in(hint)
        description = descriptions.get(field.name) or HYDRA_KEYS.get(field.name, "")
        if nested is not None and how == "":
            summary = (inspect.getdoc(nested) or "").split("\n\n")[0]
            rows.append(Row(key, type_name(hint), "", description or " ".join(plain_roles(summary).split())))
        else:
            rows.append(Row(key, type_name(hint), _default_of(field) if defaults else "", description))
        if nested is not None:
            rows += rows_of(nested, f"{key}{how}.", defaults=defaults)
    return rows


def _default_value(field: dataclasses.Field) -> Any:
    """A field's default value; OmegaConf's ``MISSING`` where it has none."""
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return MISSING


def _default_of(field: dataclasses.Field) -> str:
    """A field's default as YAML writes it; *required* where it has none."""
    value = _default_value(field)
    return "*required*" if value == MISSING else f"`{yaml_value(value)}`"


def yaml_value(value: Any) -> str:
    """``value`` as a YAML flow value on the command line: ``null``, ``true``, ``300``, ``[]``."""
    if value is None or isinstance(value, (bool, int, float, list, dict)):
        return json.dumps(value)
    return str(value)


def table(rows: list[Row], *, columns: tuple[str, ...] = ("Key", "Type", "Default", "Description")) -> str:
    """``rows`` as a Markdown table."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|") or "—"

    lines = [f"| {' | '.join(columns)} |", f"|{'---|' * len(columns)}"]
    for row in rows:
        cells = {"Key": f"`{row.key}`", "Type": row.type, "Default": row.default, "Description": row.description}
        values = [cells[column] for column in columns]
        lines.append(f"| {' | '.join(cell(value) for value in values)} |")
    return "\n".join(lines)


# -- configuration --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Option:
    """One file of a config group in ``conf/``: ``cluster=simulated`` is ``conf/cluster/simulated.yaml``."""

    group: str
    name: str
    schema: str | None
    description: str
    values: dict[str, Any]


def config_schemas() -> tuple[type, dict[str, dict[str, type]]]:
    """The top-level schema and each group's schemas by name, as ``register_configs`` puts them in Hydra's
    ConfigStore."""
    from hydra.core.config_store import ConfigStore

    from elastic_trainer.config._schemas import register_configs

    register_configs()
    repo = ConfigStore.instance().repo
    groups = {group: {name.removesuffix(".yaml"): OmegaConf.get_type(node.node) for name, node in entries.items()}
              for group, entries in repo["schema"].items()}
    return OmegaConf.get_type(repo["base_config.yaml"].node), groups


def config_options() -> tuple[dict[str, str], list[Option]]:
    """The groups ``conf/config.yaml`` chooses by default (group -> option), and every option of ``conf/``."""
    root = importlib.resources.files("elastic_trainer_conf")
    top = OmegaConf.load(root / "config.yaml")
    chosen = {key: value for entry in top.defaults if isinstance(entry, Mapping) for key, value in entry.items()}
    options = []
    for group in sorted(path for path in root.iterdir() if path.is_dir() and not path.name.startswith("_")):
        for file in sorted(path for path in group.iterdir() if path.name.endswith(".yaml")):
            text = file.read_text()
            values = OmegaConf.to_container(OmegaConf.create(text), resolve=False)
            schema = next((entry.split("/")[-1].split("@")[0] for entry in values.pop("defaults", [])
                           if isinstance(entry, str) and entry.startswith("/schema/")), None)
            options.append(Option(group.name, file.name.removesuffix(".yaml"), schema, _header(text), values))
    return chosen, options


def _header(yaml_text: str) -> str:
    """The first sentence of a YAML file's leading comment (``# @package`` lines and examples left out)."""
    lines = []
    for line in yaml_text.splitlines():
        if not line.startswith("#") or line.startswith("#  ") or line.strip() == "#":
            if lines:
                break
            continue
        if not line.startswith("# @package"):
            lines.append(line.removeprefix("#").strip())
    first = re.split(r"(?<=[.:])\s+(?=[A-Z])", " ".join(lines))[0]
    return first.removesuffix(", for example:").removesuffix(":")


def _choose(group: str, chosen: Mapping[str, str]) -> str:
    """How the command line picks an option of ``group``: ``cluster=NAME`` for a group in the defaults list,
    ``+strategy=NAME`` for one that is not."""
    return f"{group}=NAME" if group in chosen else f"+{group}=NAME"


def _changed(values: Mapping[str, Any], schema: type | None, prefix: str = "") -> list[str]:
    """``key=value`` for each value an option file sets that differs from its schema's default (for an option
    with no schema, a ``# @package _global_`` one, every value it sets but Hydra's own)."""
    fields = {field.name: field for field in dataclasses.fields(schema)} if schema is not None else {}
    changed = []
    for name, value in values.items():
        field = fields.get(name)
        nested = _dataclass_in(typing.get_type_hints(schema)[name])[0] if field is not None else None
        if schema is None and (name == "hydra" or isinstance(value, dict)):
            changed += [] if name == "hydra" else _changed(value, None, f"{prefix}{name}.")
            continue
        if isinstance(value, dict) and nested is not None:
            changed += _changed(value, nested, f"{prefix}{name}.")
            continue
        if field is not None and _default_value(field) == value:
            continue
        if isinstance(value, list) and value and all(isinstance(item, dict) and "_target_" in item for item in value):
            shown = "[" + ", ".join(item["_target_"].rsplit(".", 1)[-1] for item in value) + "]"
        else:
            shown = yaml_value(value)
        changed.append(f"`{prefix}{name}={shown}`")
    return changed


def configuration_markdown(base: type, schemas: Mapping[str, Mapping[str, type]], chosen: Mapping[str, str],
                           options: list[Option]) -> str:
    """The configuration reference: the top-level keys, then each group's options and its schemas' keys."""
    in_base = [field.name for field in dataclasses.fields(base)]
    groups = sorted({*schemas, *(option.group for option in options)},
                    key=lambda group: (group not in in_base, in_base.index(group) if group in in_base else 0, group))
    top = [row if row.key not in schemas else dataclasses.replace(
               row, type="group", default=f"`{chosen[row.key]}`" if row.key in chosen else "—",
               description=f"{row.description} ([`{_choose(row.key, chosen)}`](#group-{row.key}))")
           for row in rows_of(base)]
    parts = ["## Top-level keys", "", "Set on the command line as `key=value` (`trainer.steps=1000`).", "",
             table(top), ""]
    for group in groups:
        group_options = [option for option in options if option.group == group]
        default = f" (default: `{chosen[group]}`)" if group in chosen else " (none by default)"
        parts += [f"## {group} {{#group-{group}}}", "", f"Chosen with `{_choose(group, chosen)}`{default}.", ""]
        if group_options:
            parts += ["| Option | Schema | Sets | Description |", "|---|---|---|---|"]
            for option in group_options:
                schema = schemas.get(group, {}).get(option.schema) if option.schema else None
                sets = ", ".join(_changed(option.values, schema, f"{group}." if schema else "")) or "—"
                link = f"[`{option.schema}`](#schema-{group}-{option.schema})" if schema else "—"
                description = option.description.replace("|", "\\|") or "—"
                parts.append(f"| `{_choose(group, chosen).replace('NAME', option.name)}` | {link} | {sets} | "
                             f"{description} |")
            parts.append("")
        for name, schema in schemas.get(group, {}).items():
            used_by = [f"`{option.name}`" for option in group_options if option.schema == name]
            parts += [f"### `{group}` schema `{name}` {{#schema-{group}-{name}}}", "",
                      f"`{schema.__name__}`" + (f", used by {', '.join(used_by)}." if used_by else
                                                 " (for a config of one's own: `defaults: [/schema/"
                                                 f"{group}/{name}@_here_]`)."), "",
                      table(rows_of(schema, f"{group}.")), ""]
    return "\n".join(parts)


def configuration() -> str:
    """The configuration reference of the schemas registered now."""
    base, schemas = config_schemas()
    chosen, options = config_options()
    return configuration_markdown(base, schemas, chosen, options)


def config_groups() -> str:
    """The command line's config groups: each with its options and how to choose one."""
    chosen, options = config_options()
    lines = ["| Group | Chosen with | Default | Options |", "|---|---|---|---|"]
    for group in dict.fromkeys(option.group for option in options):
        names = ", ".join(f"`{option.name}`" for option in options if option.group == group)
        anchor = f"configuration.md#group-{group}"
        lines.append(f"| [`{group}`]({anchor}) | `{_choose(group, chosen)}` | "
                     f"{f'`{chosen[group]}`' if group in chosen else '—'} | {names} |")
    return "\n".join(lines)


# -- report.json ----------------------------------------------------------------------------------------------


def report() -> str:
    """``report.json``'s keys from its typed record, ``elastic_trainer.RunReport``."""
    from elastic_trainer import RunReport

    return table([_other_keys(row) for row in rows_of(RunReport, defaults=False)], columns=COLUMNS)


COLUMNS = ("Key", "Type", "Description")


def _other_keys(row: Row) -> Row:
    """A record's ``extra`` field as what it is in the JSON: the keys the record does not know, written at the
    level of the others (``elastic_trainer._json_records``)."""
    from elastic_trainer._json_records import EXTRA

    if row.key != EXTRA and not row.key.endswith(f".{EXTRA}"):
        return row
    return dataclasses.replace(row, key=f"{row.key.removesuffix(EXTRA)}*",
                               description=f"any other key: {row.description}")


# -- hooks ----------------------------------------------------------------------------------------------------


BANNER = re.compile(r"^# -+\n# (.+)\n# -+$", re.MULTILINE)


def hooks() -> str:
    """Each hook of ``elastic_trainer.hookspecs`` rendered by mkdocstrings, under the headings that
    ``hookspecs.py`` groups them by."""
    module = _static_module("elastic_trainer.hookspecs")
    source = Path(module.filepath).read_text()
    banners = [(source[:match.start()].count("\n") + 1, match.group(1)) for match in BANNER.finditer(source)]
    specs = [function for function in module.functions.values()
             if any(str(decorator.value).startswith("hookspec") for decorator in function.decorators)]
    parts = []
    for index, (line, title) in enumerate(banners):
        end = banners[index + 1][0] if index + 1 < len(banners) else float("inf")
        parts += [f"## {title}", ""]
        parts += [f"::: elastic_trainer.hookspecs.{spec.name}\n    options:\n      heading_level: 3\n"
                  for spec in specs if line < spec.lineno < end]
    return "\n".join(parts)


# -- the command line -----------------------------------------------------------------------------------------


def exit_codes() -> str:
    """The command line's exit statuses, their values from the constants the code returns."""
    from elastic_trainer._preemption import exit_status
    from elastic_trainer.launch._cli import EXIT_BAD_INPUT, EXIT_TRAINING_STOPPED
    from elastic_trainer.launch._supervisor import RESTART_EXIT_CODE

    rows = [
        ("0", "training completed `trainer.steps` steps (in a multirun: every job did)"),
        (str(EXIT_BAD_INPUT), "bad input: a configuration value or override, a plugin that failed to load or broke "
                              "its hook's contract (`PluginError`), or a directory another run holds "
                              "(`RunLockedError`); one sentence on stderr says what is wrong and how to fix it"),
        (str(EXIT_TRAINING_STOPPED), "training stopped before its last step (`TrainingStopped`): a failure with no "
                                     "strategy, a strategy that gave up, a fatal error, no state left to restore, or "
                                     "`checkpoint.max_failed_saves` failed saves in a row; stderr and `report.json` "
                                     "say why"),
        (str(RESTART_EXIT_CODE), "a worker whose strategy asks for a fresh process (EX_TEMPFAIL); the supervisor, "
                                 "launcher or scheduler that started it starts it again"),
        (f"128 + N ({exit_status(15)} for SIGTERM, {exit_status(2)} for Ctrl-C)",
         "stopped by signal N (SIGTERM, SIGINT or `trainer.preemption_signal`) at a step boundary, after a "
         "checkpoint; `checkpoint.resume=true` goes on from it"),
    ]
    lines = ["| Status | Meaning |", "|---|---|"] + [f"| {status} | {meaning} |" for status, meaning in rows]
    return "\n".join(lines)


GENERATORS: dict[str, Callable[[], str]] = {
    "configuration": configuration,
    "config_groups": config_groups,
    "report": report,
    "hooks": hooks,
    "exit_codes": exit_codes,
}
"""The generated parts by the name a page's ``<!-- generated: NAME -->`` line gives."""
