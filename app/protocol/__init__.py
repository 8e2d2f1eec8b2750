"""Pure protocol data: watermarks, canonical JSON, messages, change-log codec, envelopes.

Imports only the standard library and orjson.  The submodules are the API; the
names below are the ones most callers need.
"""

from app.protocol.canonical_json import dumps, loads
from app.protocol.errors import ErrorType
from app.protocol.lexi import InvalidWatermarkError, from_lexi, to_lexi
from app.protocol.messages import MessageValidationError, parse_change_source_message

__all__ = [
    "ErrorType",
    "InvalidWatermarkError",
    "MessageValidationError",
    "dumps",
    "from_lexi",
    "loads",
    "parse_change_source_message",
    "to_lexi",
]
