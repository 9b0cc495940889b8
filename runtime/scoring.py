"""MLflow's scoring protocol for any pyfunc model: request parsing, signature checks, batched predict, answers.

``POST /invocations`` takes what ``mlflow models serve`` takes (JSON with exactly one of ``dataframe_split``,
``dataframe_records``, ``instances``, ``inputs`` and optional ``params``; ``text/csv``; Parquet) and answers what
it answers (``{"predictions": ...}``), so its clients need no change. Two common signatures have fast paths that
build the model's input without pandas per request:

- one unnamed tensor of numbers (``mlflow.pytorch``, Keras, ...) with ``inputs``/``instances``: numpy straight
  from the parsed JSON; a batch is one ``np.concatenate``;
- named columns of scalar types (``mlflow.sklearn`` on a DataFrame, ...) with ``dataframe_split`` or
  ``dataframe_records``: each request's values gathered per column, ONE DataFrame per batch (with an index of its
  own: a ``dataframe_split`` index is checked for length, not passed on); when every column has one numeric type
  (ten ``double`` columns, say), the batch is one 2-D array under the DataFrame (one block, not one per column).

Everything else goes through MLflow's own parsers (``mlflow.pyfunc.scoring_server``) on a helper thread, then its
schema check, so the model sees what MLflow would give it. Either way the input is checked against the signature
before it is queued: a mismatch is a 422 naming the column, the element or the shape, never a pandas dump, and a
bad request never fails the batch it would have joined. Predictions are ``PyFuncModel.predict`` on the batch
(which enforces the schema as MLflow does), split back by row counts, and encoded as MLflow encodes them. A batch
of a fast path whose input already has the signature's exact types (numeric columns, in the signature's order,
of its dtypes; a tensor of its dtype and shape) skips MLflow's schema enforcement, which would hand the model the
same input after rebuilding it (a third of a small model's time per batch): ``PyFuncModel.predict`` less that
step (``runtime.direct``). When a batch fails, or its output does not have one row per input row, each request is
predicted alone.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from io import BytesIO, StringIO
from itertools import chain
from typing import Any, cast

import numpy as np
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.models.utils import _enforce_params_schema, _enforce_schema
from mlflow.pyfunc import PyFuncModel
from mlflow.pyfunc import scoring_server as mlflow_scoring
from mlflow.pyfunc.utils.serving_data_parser import SUPPORTED_LLM_FORMATS
from mlflow.types import DataType
from mlflow.types.schema import ColSpec, TensorSpec
from mlflow.utils.proto_json_utils import NumpyEncoder, _get_jsonable_obj

from runtime.direct import DirectPredict
from runtime.jsonio import canonical as _canonical
from runtime.jsonio import dumps as _dumps
from runtime.jsonio import error_body
from runtime.jsonio import loads as _loads
from runtime.request_problems import NUMBER, describe, element_problem, index_text, shape_problem, shape_text

log = logging.getLogger("runtime.scoring")

JSON = "application/json"
CSV = "text/csv"
PARQUET = "application/vnd.apache.parquet"
MEDIA_TYPES = (JSON, CSV, PARQUET)
DF_SPLIT, DF_RECORDS, INSTANCES, INPUTS = "dataframe_split", "dataframe_records", "instances", "inputs"
FORMATS = (DF_SPLIT, DF_RECORDS, INSTANCES, INPUTS)
_FORMAT_SET = frozenset(FORMATS)
_LLM_KEYS = frozenset(SUPPORTED_LLM_FORMATS)
_REQUIRED = (
    'a JSON object with exactly one of "dataframe_split", "dataframe_records", "instances" or "inputs", '
    'and optionally "params"'
)

# dataframe_split objects of the column fast path: "columns" and "data", and "index" (checked, not kept: a batch's
# DataFrame has its own index; ndarray and DataFrame answers are split by position, not by index).
_SPLIT_KEYS = (frozenset({"columns", "data"}), frozenset({"columns", "data", "index"}))

# Kinds of parsed request; a batch holds requests of one kind and key only.
TENSOR, COLUMNS, FRAME, ARRAY, SOLO = "tensor", "columns", "frame", "array", "solo"

# Column types of the column fast path: numpy dtype (None: let pandas infer, as MLflow's parser does) and the
# Python types a JSON value of the column may have.
_COLUMN_TYPES: dict[DataType, tuple[Any, frozenset[type], str]] = {
    DataType.double: (np.float64, NUMBER | {type(None)}, "numbers (null for missing)"),
    DataType.float: (np.float32, NUMBER | {type(None)}, "numbers (null for missing)"),
    DataType.long: (np.int64, NUMBER, "integers"),
    DataType.integer: (np.int32, NUMBER, "integers"),
    DataType.boolean: (None, frozenset({bool}), "booleans"),
    DataType.string: (None, frozenset({str}), "strings"),
}


def _cell(prefix: str, column: str | int) -> Callable[[int], str]:
    """How a 422 names row ``i``'s value of ``column``: ``"dataframe_split.data[3][1]"``,
    ``"dataframe_records[3]['x']"``."""
    return lambda i: f'"{prefix}[{i}][{column!r}]"'


class RequestError(Exception):
    """A request that cannot be scored as sent; ``status`` is its HTTP status, the message says what to fix."""

    def __init__(self, status: int, message: str, error_code: str = "BAD_REQUEST") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_code = error_code

    def body(self) -> bytes:
        return error_body(self.message, self.error_code)


def _mismatch(message: str) -> RequestError:
    return RequestError(422, message, "INVALID_PARAMETER_VALUE")


@dataclass(slots=True)
class Scoring:
    """One parsed request, ready to join a batch of the same ``key``."""

    kind: str
    data: Any  # TENSOR/ARRAY: ndarray; COLUMNS: one list of values per signature column; FRAME: DataFrame
    rows: int
    params: dict[str, Any] | None
    key: Hashable
    unwrap: bool = False  # MLflow's unified LLM format: the answer is the predictions themselves


class Scorer:
    """Parses requests for one loaded pyfunc model and predicts batches of them.

    ``parse`` is cheap (the fast paths; None when a request needs MLflow's parsers) and runs on the event loop;
    ``parse_slow`` runs MLflow's parsers and belongs on a helper thread; ``predict_many`` runs on the predict
    thread (``runtime.batching.Batcher``). ``fallbacks`` counts batches predicted again one request at a time.
    """

    def __init__(self, model: PyFuncModel, max_request_rows: int) -> None:
        self.model = model
        self.max_request_rows = max_request_rows
        meta = model.metadata
        self.input_schema = meta.get_input_schema()
        self.params_schema = meta.get_params_schema()
        self.flavor = model.loader_module
        hint = getattr(meta, "_is_signature_from_type_hint", None)
        self._type_hint = bool(hint()) if hint is not None else False
        self._tensor = self._tensor_spec()
        self._columns = self._column_specs()
        self._block = self._block_layout()
        # The fast paths' batches that already have the signature's exact types skip MLflow's schema enforcement.
        exact = self._tensor is not None or (
            self._columns is not None and all(_COLUMN_TYPES[kind][0] is not None for _, kind in self._columns)
        )
        self._direct = DirectPredict.of(model) if exact else None
        self._media: dict[str, str] = {}
        self._warned_params = False
        self.fallbacks = 0

    def _tensor_spec(self) -> tuple[np.dtype, tuple[int, ...]] | None:
        """(dtype, shape) of a signature that is one unnamed numeric tensor with a variable batch dimension."""
        schema = self.input_schema
        if self._type_hint or schema is None or not schema.is_tensor_spec() or schema.has_input_names():
            return None
        if len(schema.inputs) != 1:
            return None
        spec: TensorSpec = schema.inputs[0]
        if spec.type.kind not in "biuf" or not spec.shape or spec.shape[0] != -1:
            return None
        return spec.type, tuple(spec.shape)

    def _column_specs(self) -> list[tuple[str, DataType]] | None:
        """The signature's columns, when every one is named, required and of a scalar type of the fast path."""
        schema = self.input_schema
        if self._type_hint or schema is None or schema.is_tensor_spec() or not schema.has_input_names():
            return None
        specs: list[ColSpec] = schema.inputs
        if not all(s.required and isinstance(s.type, DataType) and s.type in _COLUMN_TYPES for s in specs):
            return None
        names = [s.name for s in specs]
        return None if len(set(names)) != len(names) else [(str(s.name), cast(DataType, s.type)) for s in specs]

    def _block_layout(self) -> tuple[pd.Index, Any] | None:
        """(columns, numpy dtype) when every column of the fast path has one numeric type: a batch is then one
        2-D array. The columns are an object Index, made once (pandas 3's string Index costs the model's own
        column checks, sklearn's feature names, a tenth of a small model's time)."""
        if self._columns is None:
            return None
        dtypes = {_COLUMN_TYPES[kind][0] for _, kind in self._columns}
        if len(dtypes) != 1 or None in dtypes:
            return None
        return pd.Index([name for name, _ in self._columns], dtype=object), dtypes.pop()

    # --------------------------------------------------------------------------------------- parsing

    def media_type(self, content_type: str | None) -> str:
        """The request's media type, checked as MLflow checks it (415 for others, for charsets but UTF-8)."""
        if content_type is None:
            raise RequestError(415, f"no Content-Type: send one of {', '.join(MEDIA_TYPES)}")
        media = self._media.get(content_type)
        if media is not None:
            return media
        mime, *parameters = (part.strip() for part in content_type.split(";"))
        values = {k.strip().lower(): v.strip().strip('"') for k, _, v in (p.partition("=") for p in parameters)}
        if values.pop("charset", "utf-8").lower() != "utf-8":
            raise RequestError(415, f"Content-Type {content_type!r}: the scoring server only supports UTF-8")
        if values:
            raise RequestError(415, f"Content-Type {content_type!r}: unknown parameters {', '.join(values)}")
        media = mime.lower()
        if media not in MEDIA_TYPES:
            raise RequestError(
                415, f"Content-Type {content_type!r} is not supported: use one of {', '.join(MEDIA_TYPES)}"
            )
        if len(self._media) < 64:
            self._media[content_type] = media
        return media

    def parse(self, body: bytes, content_type: str | None) -> Scoring | None:
        """The request through a fast path, or None when it needs ``parse_slow``; raises ``RequestError``."""
        if self.media_type(content_type) != JSON or (self._tensor is None and self._columns is None):
            return None
        try:
            payload = _loads(body)
        except ValueError:
            return None  # NaN literals, huge integers, or not JSON: the standard library decides and words it
        if type(payload) is not dict or not _LLM_KEYS.isdisjoint(payload):
            return None
        formats = [k for k in payload if k in _FORMAT_SET]
        if len(formats) != 1:
            raise RequestError(400, f"the body must be {_REQUIRED}; got keys {list(payload)}")
        field = formats[0]
        value = payload[field]
        params = payload.get("params")
        key = self._params_key(params)
        if self._tensor is not None and field in (INPUTS, INSTANCES) and type(value) is list:
            x = self._to_tensor(value, field)
            return Scoring(TENSOR, x, len(x), params, (TENSOR, key))
        if self._columns is not None:
            if field == DF_SPLIT and type(value) is dict and _SPLIT_KEYS[0] <= value.keys() <= _SPLIT_KEYS[1]:
                columns = self._split_columns(value)
            elif field == DF_RECORDS and type(value) is list and value and set(map(type, value)) == {dict}:
                columns = self._record_columns(value)
            else:
                return None
            if columns is not None:
                return Scoring(COLUMNS, columns, len(columns[0]), params, (COLUMNS, key))
        return None

    def parse_slow(self, body: bytes, content_type: str | None) -> Scoring:
        """The request through MLflow's own parsers and schema check; raises ``RequestError``."""
        media = self.media_type(content_type)
        unwrap = False
        params = None
        try:
            if media == CSV:
                data = mlflow_scoring.parse_csv_input(StringIO(body.decode("utf-8")), schema=self.input_schema)
            elif media == PARQUET:
                data = mlflow_scoring.parse_parquet_input(BytesIO(body))
            else:
                parsed = mlflow_scoring._parse_json_data(body, self.model.metadata, self.input_schema)
                data, params, unwrap = parsed.data, parsed.params, parsed.is_unified_llm_input
        except MlflowException as exc:
            raise RequestError(400, exc.message) from None
        except UnicodeDecodeError as exc:
            raise RequestError(400, f"the body is not valid UTF-8: {exc}") from None
        key = self._params_key(params)
        if self.input_schema is not None and not self._type_hint and not unwrap:
            try:
                _enforce_schema(data, self.input_schema, self.flavor)
            except MlflowException as exc:
                raise _mismatch(f"the input does not match the model's signature: {exc.message}") from None
            except Exception as exc:  # noqa: BLE001 - pandas/numpy conversions raise many kinds
                raise _mismatch(f"the input does not match the model's signature: {exc}") from None
        rows = _rows(data)
        if rows is not None and rows > self.max_request_rows:
            raise self._too_many(rows)
        if unwrap or not rows:
            return Scoring(SOLO, data, max(rows or 1, 1), params, (SOLO, object()), unwrap)
        if isinstance(data, pd.DataFrame):
            if not isinstance(data.index, pd.RangeIndex) or data.index.start != 0 or data.index.step != 1:
                return Scoring(SOLO, data, rows, params, (SOLO, object()))  # an index of its own: predicted alone
            columns = tuple(data.columns)
            dtypes = tuple(str(t) for t in data.dtypes)
            return Scoring(FRAME, data, rows, params, (FRAME, key, columns, dtypes))
        if isinstance(data, np.ndarray):
            return Scoring(ARRAY, data, rows, params, (ARRAY, key, data.shape[1:], data.dtype.str))
        return Scoring(SOLO, data, rows, params, (SOLO, object()))

    def _params_key(self, params: Any) -> Hashable:
        """Check ``params`` against the signature; requests with equal keys may share a predict call."""
        if params is None:
            return None
        if self.params_schema is None:
            if not self._warned_params:
                self._warned_params = True
                log.warning("the model's signature declares no params: params in requests are ignored (as MLflow does)")
            return None
        try:
            _enforce_params_schema(params, self.params_schema)
        except MlflowException as exc:
            raise _mismatch(f'"params": {exc.message}') from None
        return _canonical(params)

    def _too_many(self, rows: int) -> RequestError:
        return _mismatch(f"the request has {rows} rows; at most {self.max_request_rows} (MAX_REQUEST_ROWS) per request")

    def _to_tensor(self, value: list[Any], field: str) -> np.ndarray:
        assert self._tensor is not None
        dtype, shape = self._tensor
        if not value:
            raise _mismatch(f'"{field}" is empty: send at least one row')
        if len(value) > self.max_request_rows:
            raise self._too_many(len(value))
        try:
            x = np.array(value)
        except (ValueError, TypeError):  # ragged
            raise _mismatch(shape_problem(value, shape, field) or f'"{field}" is not a regular array') from None
        if x.dtype.kind not in "biuf":
            if x.dtype.kind == "O" and dtype.kind == "f":  # nulls among numbers: NaN, as MLflow reads them
                with contextlib.suppress(ValueError, TypeError):
                    x = np.array(value, dtype=dtype)
            if x.dtype.kind not in "biuf":
                problem = shape_problem(value, shape, field) or element_problem(value, field, dtype.kind == "f")
                raise _mismatch(problem or f'"{field}" must hold numbers')
        if x.ndim != len(shape) or any(want not in (-1, got) for want, got in zip(shape, x.shape, strict=False)):
            problem = shape_problem(value, shape, field)
            raise _mismatch(problem or f'"{field}" has shape {x.shape}; the signature expects {shape_text(shape)}')
        if x.dtype == dtype:
            return x
        if dtype.kind in "iu" and x.dtype.kind == "f" and not np.array_equal(x, np.trunc(x)):
            index = tuple(int(i[0]) for i in np.nonzero(x != np.trunc(x)))
            raise _mismatch(
                f'"{field}{index_text(index)}" = {x[index].item()!r} is not an integer; the signature expects {dtype}'
            )
        with np.errstate(over="ignore", invalid="ignore"):
            y = x.astype(dtype)
        lossy = (~np.isfinite(y) & np.isfinite(x)) if dtype.kind == "f" else (y != x)
        if lossy.any():
            index = tuple(int(i[0]) for i in np.nonzero(lossy))
            raise _mismatch(f'"{field}{index_text(index)}" = {x[index].item()!r} is out of range for {dtype}')
        return y

    def _split_columns(self, value: dict[str, Any]) -> list[list[Any]] | None:
        names, data = value["columns"], value["data"]
        if type(names) is not list or type(data) is not list or not all(type(n) is str for n in names):
            return None
        if len(set(names)) != len(names) or (data and set(map(type, data)) != {list}):
            return None  # pandas decides what these mean
        if not data:
            raise _mismatch(f'"{DF_SPLIT}.data" is empty: send at least one row')
        if len(data) > self.max_request_rows:
            raise self._too_many(len(data))
        index = value.get("index", data)
        if type(index) is not list or len(index) != len(data):
            raise _mismatch(f'"{DF_SPLIT}.index" must be a list of one label per row ({len(data)})')
        width = len(names)
        if set(map(len, data)) != {width}:
            i = next(i for i, row in enumerate(data) if len(row) != width)
            raise _mismatch(f'"{DF_SPLIT}.data[{i}]" has {len(data[i])} values but "columns" names {width}')
        position = {name: j for j, name in enumerate(names)}
        self._check_missing(position)
        columns = []
        for name, kind in self._columns or ():
            j = position[name]
            values = [row[j] for row in data]
            self._check_values(name, kind, values, _cell(f"{DF_SPLIT}.data", j))
            columns.append(values)
        return columns

    def _record_columns(self, records: list[dict[str, Any]]) -> list[list[Any]]:
        if len(records) > self.max_request_rows:
            raise self._too_many(len(records))
        self._check_missing(records[0])
        columns = []
        for name, kind in self._columns or ():
            try:
                values = [record[name] for record in records]
            except KeyError:
                i = next(i for i, record in enumerate(records) if name not in record)
                raise _mismatch(f'"{DF_RECORDS}[{i}]" has no column {name!r} (use null for a missing value)') from None
            self._check_values(name, kind, values, _cell(DF_RECORDS, name))
            columns.append(values)
        return columns

    def _check_missing(self, present: dict[str, Any]) -> None:
        missing = [name for name, _ in self._columns or () if name not in present]
        if missing:
            required = [name for name, _ in self._columns or ()]
            raise _mismatch(
                f"missing column{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}: the model's "
                f"signature requires {required}"
            )

    @staticmethod
    def _check_values(name: str, kind: DataType, values: list[Any], where: Callable[[int], str]) -> None:
        _, allowed, expected = _COLUMN_TYPES[kind]
        types = set(map(type, values))
        if types <= allowed and not (float in types and kind in (DataType.long, DataType.integer)):
            return
        for i, v in enumerate(values):
            if type(v) not in allowed or (
                type(v) is float and kind in (DataType.long, DataType.integer) and not v.is_integer()
            ):
                raise _mismatch(f"column {name!r} ({kind.name}) holds {expected}; {where(i)} is {describe(v)}")

    # ------------------------------------------------------------------------------------ predicting

    def predict_many(self, items: list[Scoring]) -> list[bytes | RequestError]:
        """Answers (response bodies or errors) for requests of one key: one predict call when they can share it."""
        first = items[0]
        if len(items) == 1 or first.kind == SOLO:
            return [self._predict_alone(item) for item in items]
        counts = [item.rows for item in items]
        try:
            parts = _split(self._predict(items, first.params), counts)
        except Exception:  # each request alone says which failed and why
            log.debug("a batch of %d requests failed; predicting each alone", len(items), exc_info=True)
            parts = None
        if parts is None:
            self.fallbacks += 1
            return [self._predict_alone(item) for item in items]
        return [_encode(part, fast) for part, fast in parts]

    def _predict_alone(self, item: Scoring) -> bytes | RequestError:
        try:
            predictions = self._predict([item], item.params)
        except MlflowException as exc:
            if getattr(exc, "error_class", None) == "SCHEMA_ENFORCEMENT_FAILED":
                return _mismatch(exc.message)
            return RequestError(exc.get_http_status_code(), exc.message, exc.error_code)
        except Exception as exc:  # the model's own error: MLflow answers 400 too
            log.warning("predict failed for one request", exc_info=True)
            return RequestError(400, f"the model failed on this input: {type(exc).__name__}: {exc}")
        if item.unwrap:
            return json.dumps(_get_jsonable_obj(predictions, pandas_orient="records"), cls=NumpyEncoder).encode()
        if isinstance(predictions, np.ndarray) and _plain(predictions):
            return _encode(predictions.tolist(), True)
        return _encode(predictions, False)

    def _predict(self, items: list[Scoring], params: dict[str, Any] | None) -> Any:
        """The model's predictions for a batch (requests of one kind and key)."""
        if self._direct is not None and items[0].kind in (TENSOR, COLUMNS):
            return self._direct(self._assemble(items), params)
        return self.model.predict(self._assemble(items), params)

    def _assemble(self, items: list[Scoring]) -> Any:
        """The model input of a batch (requests of one kind)."""
        kind = items[0].kind
        if kind == COLUMNS and self._block is not None:
            columns, dtype = self._block
            if len(items) == 1:
                values = items[0].data
            else:
                values = [list(chain.from_iterable(i.data[k] for i in items)) for k in range(len(columns))]
            block = np.array(values, dtype=dtype)  # one row per column: the transpose is pandas' own layout
            return pd.DataFrame(block.T, columns=columns, copy=False)
        if kind == COLUMNS:
            merged: dict[str, Any] = {}
            for k, (name, dtype) in enumerate(self._columns or ()):
                values = items[0].data[k] if len(items) == 1 else list(chain.from_iterable(i.data[k] for i in items))
                numpy_type = _COLUMN_TYPES[dtype][0]
                merged[name] = values if numpy_type is None else np.array(values, dtype=numpy_type)
            return pd.DataFrame(merged)
        if len(items) == 1:
            return items[0].data
        if kind == FRAME:
            return pd.concat([i.data for i in items], ignore_index=True)
        return np.concatenate([i.data for i in items])


def _rows(data: Any) -> int | None:
    if isinstance(data, (pd.DataFrame, pd.Series, np.ndarray, list)):
        return len(data)
    return None


def _plain(array: np.ndarray) -> bool:
    """An array whose ``tolist()`` orjson writes as MLflow's encoder would (numbers, no NaN or infinity)."""
    kind = array.dtype.kind
    return kind in "biu" or (kind == "f" and bool(np.isfinite(array).all()))


def _split(predictions: Any, counts: list[int]) -> list[tuple[Any, bool]] | None:
    """Each request's share of a batch's predictions (with whether it is plain JSON), or None when they do
    not have one row per input row."""
    total = sum(counts)
    try:
        if len(predictions) != total or isinstance(predictions, dict):
            return None
    except TypeError:
        return None
    bounds = list(zip(np.cumsum([0, *counts[:-1]]).tolist(), np.cumsum(counts).tolist(), strict=True))
    if isinstance(predictions, np.ndarray):
        if _plain(predictions):
            rows = predictions.tolist()  # one conversion per batch; each request slices its rows
            return [(rows[a:b], True) for a, b in bounds]
        return [(predictions[a:b], False) for a, b in bounds]
    if isinstance(predictions, (pd.DataFrame, pd.Series)):
        return [(predictions.iloc[a:b], False) for a, b in bounds]
    if isinstance(predictions, list):
        return [(predictions[a:b], False) for a, b in bounds]
    return None


def _encode(predictions: Any, plain: bool) -> bytes:
    """``{"predictions": ...}`` as ``mlflow models serve`` writes it (orjson for plain numbers, else MLflow's
    own conversion and encoder, which also keeps NaN as NaN)."""
    if plain:
        return b'{"predictions":' + _dumps(predictions) + b"}"
    jsonable = _get_jsonable_obj(predictions, pandas_orient="records")
    return json.dumps({"predictions": jsonable}, cls=NumpyEncoder).encode()
