"""HTTP errors with OpenAI-style bodies: what every refused request gets (docs/serving.md,
"Errors").

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature",
               "code": null}}
"""

# HTTP status -> the OpenAI error type its body carries
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """A request the server answers with `status` and an OpenAI-style error body.

    param: the request field at fault ("messages[2].role"), named in the message too;
    code: OpenAI's machine-readable code (model_not_found, invalid_api_key, ...);
    headers: extra response headers (Retry-After on 503)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param=None, code=None) -> dict:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(
                status, "invalid_request_error" if status < 500 else "server_error"
            ),
            "param": param,
            "code": code,
        }
    }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400: a field missing, of the wrong type, out of range or not supported."""
    return APIError(400, message, param, code)
