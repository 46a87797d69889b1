"""The row formats users bring from Axolotl and LLaMA-Factory, as chat messages.

- ShareGPT: ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]}``
  with ``from`` one of ``SHAREGPT_ROLES``, an optional ``system`` string and ``tools`` (a list of
  function schemas, or LLaMA-Factory's JSON string of one). A ``function_call`` turn's value is
  the JSON of a call (``{"name": ..., "arguments": ...}``) or a list of them: an assistant turn
  that calls tools. An ``observation`` (or ``tool``) turn is the tool's result.
- Alpaca: ``{"instruction": ..., "input": ..., "output": ...}``, with optional ``system`` and
  ``history`` (earlier ``[instruction, answer]`` pairs). The user turn is the instruction, then
  the input on the next line when there is one (LLaMA-Factory's rule); the output is the answer.

Both then go through the chat template, the loss counting the answers as for ``messages`` rows.
"""

from __future__ import annotations

import json

from mfsdp.data.token_file import DataError

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "function_call": "assistant", "observation": "tool", "tool": "tool"}
"""ShareGPT's ``from`` values and the chat roles they become."""


def sharegpt_messages(row: dict) -> list[dict]:
    """A ShareGPT row's turns as chat messages (checked by ``rows`` afterwards)."""
    turns = row["conversations"]
    if not isinstance(turns, list) or not turns:
        raise DataError("'conversations' must be a non-empty list of turns; fix the row")
    messages = _system(row)
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise DataError(f"conversations turn {i} must be an object with a string 'value'; fix the row")
        source = turn.get("from")
        if source not in SHAREGPT_ROLES:
            raise DataError(f"conversations turn {i} is from {source!r}; ShareGPT turns are from "
                            f"{', '.join(SHAREGPT_ROLES)}, so rewrite it as one of those or drop it")
        if source == "function_call":
            messages.append({"role": "assistant", "content": "", "tool_calls": _calls(turn["value"], i)})
        else:
            messages.append({"role": SHAREGPT_ROLES[source], "content": turn["value"]})
    return messages


def alpaca_messages(row: dict) -> list[dict]:
    """An Alpaca row as a system turn (when it has one), its history, then the user turn and
    the answer."""
    fields = {key: row.get(key, "") for key in ("instruction", "input", "output")}
    if not {"instruction", "output"} <= row.keys() or not all(isinstance(v, str) for v in fields.values()):
        raise DataError("an Alpaca row needs string 'instruction' and 'output' fields (and 'input', "
                        "when given, a string); fix the row")
    history = row.get("history") or []
    if not isinstance(history, list) or not all(
            isinstance(pair, list) and len(pair) == 2 and all(isinstance(t, str) for t in pair) for pair in history):
        raise DataError("an Alpaca row's 'history' must be a list of [instruction, answer] string pairs; "
                        "fix the row")
    messages = _system(row)
    for question, answer in history:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    prompt = "\n".join(part for part in (fields["instruction"], fields["input"]) if part)
    return messages + [{"role": "user", "content": prompt}, {"role": "assistant", "content": fields["output"]}]


def _system(row: dict) -> list[dict]:
    system = row.get("system")
    if system is not None and not isinstance(system, str):
        raise DataError("'system' must be a string; fix the row")
    return [{"role": "system", "content": system}] if system else []


def _calls(value: str, i: int) -> list[dict]:
    """A ``function_call`` turn's calls, as ``tool_calls`` entries."""
    try:
        calls = json.loads(value)
    except json.JSONDecodeError as err:
        raise DataError(f"conversations turn {i} (function_call) is not JSON ({err}); give the call as "
                        '{"name": ..., "arguments": ...}') from None
    calls = calls if isinstance(calls, list) else [calls]
    if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        raise DataError(f"conversations turn {i} (function_call) must be a call "
                        '{"name": ..., "arguments": ...} or a list of them; fix the row')
    return [{"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}}
            for c in calls]
