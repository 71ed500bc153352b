"""Chat templates, compiled and rendered as transformers renders them, within bounds.

A chat template is code from the checkpoint's author, as hostile as any input: Jinja's
sandbox stops it reaching Python, but not a loop nest that runs for hours, ``'x' *
10**10`` or a string doubled in a namespace. So a template is

- parsed here and compiled in a sandbox (trimmed blocks, ``tojson``, ``raise_exception``,
  ``strftime_now``, loop controls), refusing by name what loads other templates
  (``include``, ``import``, ``extends``: a checkpoint has nothing to load);
- rendered only in a child process (:func:`render_bounded`) that has
  ``RENDER_SECONDS`` of CPU and wall time, ``RENDER_MEMORY`` bytes of address space and
  may answer ``RENDER_OUTPUT`` characters; a template that exceeds one is refused with
  the limit named.

:class:`pipeline.policy.chat.ChatTokenizer` renders the few conversations it needs once,
when it loads; an episode appends turns by substitution and never renders.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from pipeline.errors import InvalidConfigError

#: CPU (and wall-clock) seconds the renderings of one load may take together
RENDER_SECONDS = 2
#: address space of the rendering process
RENDER_MEMORY = 1 << 30
#: characters all renderings of one call may produce together
RENDER_OUTPUT = 1 << 20

#: template statements that load other templates, refused by name
_LOADERS = {
    jinja2.nodes.Include: "include",
    jinja2.nodes.Import: "import",
    jinja2.nodes.FromImport: "from ... import",
    jinja2.nodes.Extends: "extends",
}

#: one rendering: the messages and whether to add the generation prompt
Conversation = tuple[list[dict[str, Any]], bool]


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


def parse_template(source: str) -> jinja2.nodes.Template:
    """The syntax tree of ``source``; InvalidConfigError when it does not parse or loads
    other templates. (Parsing runs none of the template; compiling already may: Jinja
    folds constant expressions such as ``'x' * 10**10`` as it compiles.)"""
    try:
        tree = _environment().parse(source)
    except jinja2.exceptions.TemplateError as e:
        raise InvalidConfigError(f"the chat template does not compile: {e}") from None
    for kind, name in _LOADERS.items():
        if next(tree.find_all(kind), None) is not None:
            raise InvalidConfigError(
                f"the chat template uses {{% {name} %}}: a checkpoint's template must be "
                "self-contained (rlstream loads no other template)"
            )
    return tree


def compile_template(source: str) -> jinja2.Template:
    """The template, compiled: only in the rendering process."""
    tree = parse_template(source)
    try:
        return _environment().from_string(tree)
    except jinja2.exceptions.TemplateError as e:
        raise InvalidConfigError(f"the chat template does not compile: {e}") from None


def render_bounded(
    source: str,
    specials: dict[str, str],
    conversations: Sequence[Conversation],
    tools: list[dict[str, Any]] | None = None,
) -> list[str]:
    """The template's rendering of each conversation (with ``tools`` listed, as
    transformers passes them, when given), computed in a child process within the
    module's limits; InvalidConfigError naming the limit or the template's error."""
    parse_template(source)  # refused here, before a process starts, when it cannot load
    request = json.dumps(
        {
            "source": source,
            "specials": specials,
            "conversations": list(conversations),
            "tools": tools,
        }
    )
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pipeline.policy.template"],
            input=request.encode(),
            capture_output=True,
            timeout=RENDER_SECONDS + 5,  # CPU is limited in the child; this bounds waiting
            env={**os.environ, "PYTHONHASHSEED": "0"},
        )
    except subprocess.TimeoutExpired:
        raise _too_long() from None
    if len(done.stdout) > 4 * RENDER_OUTPUT + 1024:
        raise InvalidConfigError(f"the chat template writes more than {RENDER_OUTPUT} characters")
    try:
        answer = json.loads(done.stdout)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        if done.returncode < 0:  # killed for its CPU time
            raise _too_long()
        raise InvalidConfigError(
            "the chat template could not be rendered within "
            f"{RENDER_MEMORY >> 20} MB of memory and {RENDER_SECONDS} s "
            f"(exit {done.returncode}: {done.stderr.decode(errors='replace')[-200:].strip()})"
        )
    if "error" in answer:
        raise InvalidConfigError(str(answer["error"])[:500])
    out = answer.get("rendered")
    if not isinstance(out, list) or not all(isinstance(s, str) for s in out):
        raise InvalidConfigError("the chat template's renderer answered nonsense")
    return out


def _too_long() -> InvalidConfigError:
    return InvalidConfigError(
        f"the chat template takes more than {RENDER_SECONDS} s to render a short conversation"
    )


def _child() -> None:
    """The rendering process: a request on stdin, ``{"rendered": [...]}`` or
    ``{"error": sentence}`` on stdout, within the limits it sets itself first."""
    import resource

    resource.setrlimit(resource.RLIMIT_CPU, (RENDER_SECONDS, RENDER_SECONDS + 1))
    resource.setrlimit(resource.RLIMIT_AS, (RENDER_MEMORY, RENDER_MEMORY))
    try:
        request = json.loads(sys.stdin.buffer.read())
        template = compile_template(request["source"])
        out, total = [], 0
        for messages, prompt in request["conversations"]:
            text = "".join(
                _bounded_chunks(
                    template.generate(
                        messages=messages,
                        tools=request.get("tools"),
                        add_generation_prompt=prompt,
                        **request["specials"],
                    ),
                    RENDER_OUTPUT - total,
                )
            )
            total += len(text)
            out.append(text)
        answer: dict[str, Any] = {"rendered": out}
    except MemoryError:
        answer = {"error": f"the chat template needs more than {RENDER_MEMORY >> 20} MB to render"}
    except _TooMuchOutput:
        answer = {"error": f"the chat template writes more than {RENDER_OUTPUT} characters"}
    except jinja2.exceptions.TemplateError as e:
        answer = {"error": f"the chat template fails: {str(e)[:300]}"}
    except InvalidConfigError as e:
        answer = {"error": str(e)}
    except Exception as e:  # the template's own code raised: it is refused, not us
        answer = {"error": f"the chat template fails: {type(e).__name__}: {str(e)[:300]}"}
    sys.stdout.write(json.dumps(answer))


class _TooMuchOutput(Exception):
    pass


def _bounded_chunks(chunks: Any, limit: int) -> Any:
    seen = 0
    for chunk in chunks:
        seen += len(chunk)
        if seen > limit:
            raise _TooMuchOutput
        yield chunk


if __name__ == "__main__":
    _child()
