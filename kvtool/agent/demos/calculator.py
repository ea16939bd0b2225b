"""Arithmetic for the model without eval(): a whitelist walk over the Python AST."""

from __future__ import annotations

import ast
import math
import operator

from kvtool.agent.retry import ToolInputError

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCS = {
    "sqrt": math.sqrt, "log": math.log, "log10": math.log10, "exp": math.exp, "sin": math.sin, "cos": math.cos,
    "tan": math.tan, "abs": abs, "round": round, "min": min, "max": max, "floor": math.floor, "ceil": math.ceil,
}
_NAMES = {"pi": math.pi, "e": math.e, "tau": math.tau}
MAX_EXPR_CHARS = 300
MAX_POWER = 1000  # 10**1000 is fine; 9**9**9 would hang the thread


def _eval(node: ast.AST) -> float | int:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > MAX_POWER or abs(left) > 1e100):
            raise ToolInputError(f"exponent too large: {left} ** {right} (|exponent| must be <= {MAX_POWER})")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS
            and not node.keywords):
        return _FUNCS[node.func.id](*(_eval(a) for a in node.args))
    allowed = "numbers, + - * / // % **, parentheses, pi, e, tau and " + ", ".join(_FUNCS)
    raise ToolInputError(f"unsupported expression element {ast.dump(node)[:60]!r}; allowed: {allowed}")


def calculate(expression: str) -> float | int:
    if len(expression) > MAX_EXPR_CHARS:
        raise ToolInputError(f"expression is {len(expression)} characters; the limit is {MAX_EXPR_CHARS}")
    try:
        tree = ast.parse(expression.replace("^", "**"), mode="eval")
    except SyntaxError as exc:
        raise ToolInputError(f"cannot parse {expression!r}: {exc.msg}") from None
    try:
        return _eval(tree)
    except (ZeroDivisionError, ValueError, OverflowError, TypeError) as exc:
        raise ToolInputError(f"cannot evaluate {expression!r}: {exc}") from None
