"""memscope.msmemscope.describe: msMemScope's ``describe`` module (``describer``), mapped onto
memscope's owner labels.

The four msMemScope forms all work: ``@describer(owner="x")``, ``with describer(owner="x"):``,
explicit ``d.__enter__()`` / ``d.__exit__(None, None, None)``, and
``describer(tensor_or_addr, owner="x")``, which tags the block at once at USER_DEFINED_1 as
msMemScope's ``describe_addr(addr, [(owner, USER_DEFINED_1)])`` does.
"""

from .. import USER, USER_DEFINED_1, Describer, describe as _describe

__all__ = ["describer", "Describer"]


def describer(target=None, owner=None):
    """A label span (``describer(owner="x")``) or, given a tensor or address, an immediate tag."""
    if target is None or isinstance(target, str):
        return _describe(target, owner=owner, level=USER)
    return _describe(target, owner=owner, level=USER_DEFINED_1)
