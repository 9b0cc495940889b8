"""Each workload's deployments get that workload's own hyperparameters as their form in the Prefect UI.

A flow's parameter schema comes from its signature, where ``training.hyperparameters`` is any mapping: the
values are checked against the workload's JSON Schema when the run starts. A deployment of one workload can
do better: its schema can *be* the workload's, so the UI renders a field per hyperparameter (types, bounds,
enums, defaults, nested objects) and the server refuses a run whose parameters do not match, before any
worker picks it up. ``prefect.yaml`` has no field for that, and ``prefect deploy`` sends the signature's
schema again, so run this after it:

    prefect deploy --all && python -m deployments.forms          # every deployment with a `workload`
    python -m deployments.forms --deployment retrain/weekly        # just these

It reads each deployment's ``workload`` parameter, loads that workload (a path relative to this directory,
or a git URL), and updates the deployment: the flow's schema with ``training.hyperparameters`` replaced by
the workload's schema (its defaults filled in), the sweep grid's names limited to the declared ones,
``workload`` fixed to that workload, and ``enforce_parameter_schema`` on.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
from collections.abc import Iterable
from typing import Any

from blocks.workload.hparams import closed
from blocks.workload.source import Workload, load_workload

log = logging.getLogger("gpuferry.forms")

# The flows whose deployments train a workload (name -> entrypoint), and their parameter schemas.
WORKLOAD_FLOWS = {"retrain": "flows.retrain:retrain", "sweep": "flows.sweep:sweep"}
PREFIX = "workload_"


def _rewrite_refs(node: Any, defs_key: str) -> Any:
    """``$ref``s into the workload schema's own ``$defs`` (or ``definitions``), pointed at the root's copies."""
    if isinstance(node, dict):
        out = {k: _rewrite_refs(v, defs_key) for k, v in node.items()}
        ref = out.get("$ref")
        if isinstance(ref, str) and ref.startswith(f"#/{defs_key}/"):
            out["$ref"] = f"#/definitions/{PREFIX}{ref.rsplit('/', 1)[1]}"
        return out
    if isinstance(node, list):
        return [_rewrite_refs(v, defs_key) for v in node]
    return node


_SUBSCHEMAS = ("items", "additionalProperties", "prefixItems", "anyOf", "oneOf", "allOf")


def _for_the_form(schema: Any) -> None:
    """At every level of a (closed) schema: each object's fields in the order of the workload's file (the form
    sorts by ``position``), and its keys limited to the declared ones by ``propertyNames`` ahead of
    ``additionalProperties``, so that the server's refusal of an unknown key names the valid ones (it reports the
    first failing keyword: ``'warmpu' is not one of ['warmup_steps', 'decay']``)."""
    if isinstance(schema, list):
        for sub in schema:
            _for_the_form(sub)
        return
    if not isinstance(schema, dict):
        return
    properties = schema.get("properties") or {}
    for position, sub in enumerate(properties.values()):
        if isinstance(sub, dict):
            sub.setdefault("position", position)
    for key in _SUBSCHEMAS:
        _for_the_form(schema.get(key))
    for sub in properties.values():
        _for_the_form(sub)
    if properties and schema.get("additionalProperties") is False and "propertyNames" not in schema:
        del schema["additionalProperties"]
        schema["propertyNames"] = {"enum": list(properties)}
        schema["additionalProperties"] = False


def _hyperparameters(workload: Workload) -> tuple[dict[str, Any], dict[str, Any]]:
    """The workload's schema as a property of TrainingSpec, and the definitions it brings along."""
    # Closed at every level, as the run's own check closes it: the server refuses a key the workload does not
    # declare, in a nested object too, before any worker picks the run up.
    schema = closed(copy.deepcopy(workload.definition.schema.schema))
    schema.pop("$schema", None)
    schema.pop("$id", None)
    definitions: dict[str, Any] = {}
    for key in ("$defs", "definitions"):
        for name, sub in (schema.pop(key, None) or {}).items():
            definitions[f"{PREFIX}{name}"] = _rewrite_refs(sub, key)
        schema = _rewrite_refs(schema, key)
        definitions = {k: _rewrite_refs(v, key) for k, v in definitions.items()}
    for node in (schema, *definitions.values()):
        _for_the_form(node)
    schema["title"] = f"Hyperparameters of {workload.name}"
    schema["description"] = (
        workload.definition.description + " " if workload.definition.description else ""
    ) + "Declared in the workload's gpuferry.yaml; left out: its default."
    schema["default"] = workload.definition.schema.defaults
    return schema, definitions


def workload_schema(flow_schema: dict[str, Any], workload: Workload, source: str) -> dict[str, Any]:
    """``flow_schema`` (a flow's parameter schema, as Prefect makes it) for runs of ``workload`` only."""
    out = copy.deepcopy(flow_schema)
    definitions = out.setdefault("definitions", {})
    properties = out["properties"]
    hyperparameters, extra = _hyperparameters(workload)
    definitions.update(extra)
    if "TrainingSpec" in definitions:
        training = definitions["TrainingSpec"]
        training["properties"]["hyperparameters"] = hyperparameters
        training["title"] = f"Training of {workload.name}"
        default = properties.get("training", {}).get("default")
        if isinstance(default, dict):
            default["hyperparameters"] = workload.definition.schema.defaults
    names = workload.definition.schema.names
    grid = definitions.get("SweepGrid")
    if grid is not None and names:
        grid["properties"]["values"]["propertyNames"] = {"enum": names}
        declared = closed(workload.definition.schema.schema.get("properties", {}))
        configuration = {
            "type": "object",
            "properties": _rewrite_refs(copy.deepcopy(declared), "$defs"),
            "additionalProperties": False,
        }
        _for_the_form(configuration)
        grid["properties"]["configurations"]["items"] = configuration
    properties["workload"] = {
        **properties.get("workload", {}),
        "type": "string",
        "enum": [source],
        "default": source,
        "description": f"This deployment trains {workload.name} ({source}); its form follows that workload's "
        "gpuferry.yaml. Another workload gets a deployment of its own.",
    }
    # The deployment supplies it: not required of the run form, so the UI's Quick run starts a run at once
    # (the UI opens the parameters dialog for a schema with required fields).
    out["required"] = [name for name in out.get("required", []) if name != "workload"]
    if not out["required"]:
        del out["required"]
    return out


def _flow_schema(flow_name: str) -> dict[str, Any]:
    import importlib

    from prefect.utilities.callables import parameter_schema

    module, _, name = WORKLOAD_FLOWS[flow_name].partition(":")
    return parameter_schema(getattr(importlib.import_module(module), name)).model_dump_for_openapi()


def apply_forms(deployments: Iterable[str] = ()) -> list[str]:
    """Give each deployment (``flow/name``; none given: every one of a workload flow with a ``workload``
    parameter) its workload's form. Returns the names it updated."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentUpdate
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    wanted = list(deployments)
    updated = []
    with get_client(sync_client=True) as client:
        if wanted:
            found = [client.read_deployment_by_name(name) for name in wanted]
        else:
            flows = client.read_flows(flow_filter=FlowFilter(name=FlowFilterName(any_=list(WORKLOAD_FLOWS))))
            names = {f.id: f.name for f in flows}
            found = [d for d in client.read_deployments(limit=200) if d.flow_id in names]
        flow_names = {f.id: f.name for f in client.read_flows(limit=200)}
        schemas: dict[str, dict[str, Any]] = {}
        for deployment in found:
            flow_name = flow_names.get(deployment.flow_id, "")
            source = (deployment.parameters or {}).get("workload")
            if flow_name not in WORKLOAD_FLOWS or not isinstance(source, str) or not source:
                log.info("%s/%s: no workload parameter, left as it is", flow_name, deployment.name)
                continue
            workload = load_workload(source)
            flow_schema = schemas.setdefault(flow_name, _flow_schema(flow_name))
            schema = workload_schema(flow_schema, workload, source)
            client.update_deployment(
                deployment.id, DeploymentUpdate(parameter_openapi_schema=schema, enforce_parameter_schema=True)
            )
            updated.append(f"{flow_name}/{deployment.name}")
            log.info(
                "%s/%s: the form of %s (%d hyperparameters)",
                flow_name,
                deployment.name,
                workload.name,
                len(workload.definition.schema.names),
            )
    return updated


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deployment", action="append", default=[], help="flow/name (default: every one)")
    parser.add_argument("--print-schema", metavar="WORKLOAD", help="print the retrain form of WORKLOAD and exit")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.print_schema:
        print(
            json.dumps(
                workload_schema(_flow_schema("retrain"), load_workload(args.print_schema), args.print_schema), indent=2
            )
        )
        return 0
    updated = apply_forms(args.deployment)
    print(f"{len(updated)} deployment(s) now have their workload's form: {', '.join(updated) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
