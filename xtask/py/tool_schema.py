"""The ``tools`` entries of OpenAI chat requests, shared by the agent-server
fixture (``tool_fixture.py``) and the client check (``openai_tools_check.py``).
Plain Python: the check runs where only the ``openai`` client is installed."""

from __future__ import annotations


def function_tool(name: str, properties: dict, required: list[str], description: str | None = None) -> dict:
    """A function tool ``name`` (with ``description`` where given) whose
    arguments are an object of ``properties``, the ``required`` ones among
    them, in the key order of the OpenAI API reference (as templates render
    it)."""
    function = {"name": name} if description is None else {"name": name, "description": description}
    function["parameters"] = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": function}
