import os
if os.environ.get("AB_PY_PARSER"):
    try:
        import aiohttp.web_protocol as wp
        from aiohttp.http_parser import HttpRequestParserPy
        wp.HttpRequestParser = HttpRequestParserPy
    except Exception as exc:  # noqa
        print("pyparser patch failed", exc)
    else:
        import sys
        print("pyparser patch applied", file=sys.stderr)
