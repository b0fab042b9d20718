"""`python -m schemathesis.cli`, with one CPython bug kept out of the run.

hypothesis names a filtered strategy by parsing its lambda's source file (ast.parse).
CPython 3.11 up to 3.11.7 (this machine's) can raise a spurious SystemError there, "AST
constructor recursion depth mismatch" (python/cpython#106905), when parses run in several
threads, as schemathesis's `--workers 2` does: a run then ends in a "Runtime Error" of the
tool, not of the server, with every generated request passed. Here such a lambda is named
as hypothesis names any lambda whose source it cannot read ("lambda x: <unknown>"); only a
strategy's name changes, not what it draws.
"""

import inspect
import runpy

from hypothesis.internal import lambda_sources

_describe = lambda_sources._lambda_description


def _lambda_description(f, *args, **kwargs):
    try:
        return _describe(f, *args, **kwargs)
    except SystemError:
        signature = str(inspect.signature(f))[1:-1]
        return f"lambda {signature}: <unknown>" if signature else "lambda: <unknown>"


lambda_sources._lambda_description = _lambda_description
runpy.run_module("schemathesis.cli", run_name="__main__", alter_sys=True)
