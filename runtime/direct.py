"""``PyFuncModel.predict`` less MLflow's schema enforcement, for batches that already have the signature's exact types.

``runtime.scoring``'s fast paths build a batch's input with the signature's exact types: numeric columns in the
signature's order, each of its dtype (checked value by value when each request was parsed), or one tensor of its
dtype and shape. For such input MLflow's ``_enforce_schema`` only rebuilds the same DataFrame (or checks the same
array) again, which for a small model is about a third of each predict call.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from mlflow.models.utils import _enforce_params_schema
from mlflow.pyfunc import PyFuncModel

log = logging.getLogger("runtime.scoring")


class DirectPredict:
    """What ``PyFuncModel.predict`` does but the schema enforcement: MLflow's prediction context (tracing, the
    model's dependencies schemas and id), its params enforcement, its call of the model's predict function. ``of``
    gives None when this MLflow's predict does more (types from type hints or an input example) or its parts are
    not where this expects them: batches then go through ``PyFuncModel.predict`` itself."""

    def __init__(self, model: PyFuncModel) -> None:
        from mlflow.models.dependencies_schemas import _get_dependencies_schema_from_model
        from mlflow.pyfunc.context import Context, set_prediction_context
        from mlflow.tracing.utils import _try_get_prediction_context

        meta = model.metadata
        if meta._is_signature_from_type_hint() or meta._is_type_hint_from_example():
            raise LookupError("the model's predict converts its input by type hints")
        name = meta.flavors.get("python_function", {}).get("predict_fn") or "predict"
        self._fn = getattr(model._model_impl, name)
        takes = inspect.signature(self._fn).parameters.get("params")
        self._takes_params = takes is not None and takes.kind != inspect.Parameter.VAR_KEYWORD
        self._params_schema = meta.get_params_schema()
        self._dependencies = _get_dependencies_schema_from_model(meta)
        self._model_id = model.model_id
        self._context, self._set_context, self._current_context = (
            Context,
            set_prediction_context,
            _try_get_prediction_context,
        )

    @classmethod
    def of(cls, model: PyFuncModel) -> DirectPredict | None:
        try:
            return cls(model)
        except (ImportError, AttributeError, LookupError, TypeError, ValueError) as exc:
            log.info("batches go through PyFuncModel.predict with its schema enforcement: %s", exc)
            return None

    def __call__(self, data: Any, params: dict[str, Any] | None) -> Any:
        context = self._current_context() or self._context()
        with self._set_context(context):
            if self._dependencies:
                context.update(**self._dependencies)
            if self._model_id:
                context.update(model_id=self._model_id)
            if self._params_schema is not None:
                params = _enforce_params_schema(params, self._params_schema)
            elif params not in (None, {}):
                params = {}  # what MLflow passes on (parse warned once that they are ignored)
            return self._fn(data, params=params) if self._takes_params else self._fn(data)
