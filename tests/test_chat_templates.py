"""Chat templates rendered without transformers' tokenizer classes, which
import torch (llm/run/chat.py): the text apply_chat_template builds, for
every way a folder keeps its templates and its special tokens."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from executorch_mlx.llm.model_folders import CHATML, write_model_folder
from executorch_mlx.llm.run.chat import ChatTemplate

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "sunny"},
            {"role": "user", "content": "And tomorrow?"}]
# A template that shows the special tokens by name and the tools as JSON.
TOKENS = ("{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}{{ eos_token }}\n{% endfor %}"
          "{% if tools %}{{ tools | tojson }}{% endif %}{{ pad_token }}{% if add_generation_prompt %}A:{% endif %}")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_model_folder(tmp_path_factory.mktemp("chat") / "model", "qwen2", layers=1, hidden=32, heads=2,
                              kv_heads=1, intermediate=64, chat=True, tools=True)


def _config(path):
    return json.loads((path / "tokenizer_config.json").read_text())


def _write_config(path, config):
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def _layout(folder, tmp_path, name):
    """A copy of `folder` keeping its templates and special tokens in one of the ways transformers reads."""
    path = shutil.copytree(folder, tmp_path / name)
    config = _config(path)
    if name == "in the config":
        (path / "chat_template.jinja").unlink()
        _write_config(path, {**config, "chat_template": CHATML})
    elif name == "named in the config":  # the tool-use one chosen when there are tools
        (path / "chat_template.jinja").unlink()
        _write_config(path, {**config, "chat_template": [{"name": "default", "template": TOKENS},
                                                         {"name": "tool_use", "template": CHATML}]})
    elif name == "files over the config":  # the files replace the config's templates
        _write_config(path, {**config, "chat_template": "config's: never used", "pad_token": None})
        (path / "chat_template.jinja").write_text(TOKENS)
        (path / "additional_chat_templates").mkdir()
        (path / "additional_chat_templates" / "tool_use.jinja").write_text(CHATML)
    elif name == "token objects":
        (path / "chat_template.jinja").write_text(TOKENS)
        bos = {"__type": "AddedToken", "content": config["bos_token"], "lstrip": False, "normalized": False,
               "rstrip": False, "single_word": False, "special": True}
        _write_config(path, {**config, "bos_token": bos,
                             "pad_token": "<pad>"})
    elif name == "legacy special tokens map":  # read only without added_tokens_decoder; it wins over the config
        (path / "chat_template.jinja").write_text(TOKENS)
        config.pop("added_tokens_decoder", None)
        _write_config(path, {**config, "eos_token": "config's"})
        (path / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": config["eos_token"]},
                                                                  "pad_token": "<pad>"}))
    return path


@pytest.mark.parametrize("name", ["as written", "in the config", "named in the config", "files over the config",
                                  "token objects", "legacy special tokens map"])
def test_a_template_renders_what_transformers_renders(folder, tmp_path, name):
    path = _layout(folder, tmp_path, name)
    ours, theirs = ChatTemplate(path), AutoTokenizer.from_pretrained(path)
    if name != "named in the config":  # (whose default template shows a pad token the folder does not name)
        ours._tokenizer = lambda: pytest.fail("the folder names every special token its template shows")
    for tools in (None, TOOLS):
        want = theirs.apply_chat_template(MESSAGES, tools=tools, tokenize=False, add_generation_prompt=True)
        assert ours.render(MESSAGES, tools=tools) == want, (name, tools)
    if name in ("token objects", "legacy special tokens map"):  # the case shows what it sets
        assert "<pad>" in ours.render(MESSAGES) and "config's" not in ours.render(MESSAGES)


def test_rendering_imports_no_torch(folder):
    code = f"""
import sys
from executorch_mlx.llm.run.chat import ChatTemplate
ChatTemplate({str(folder)!r}).render([{{"role": "user", "content": "Hi"}}])
print("torch" in sys.modules)
"""
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_a_folder_with_named_templates_and_no_default_says_so(folder, tmp_path):
    path = shutil.copytree(folder, tmp_path / "named")
    (path / "chat_template.jinja").unlink()
    _write_config(path, {**_config(path), "chat_template": [{"name": "tool_use", "template": CHATML}]})
    assert ChatTemplate(path).render(MESSAGES, tools=TOOLS)
    with pytest.raises(ValueError, match=r"has chat templates \['tool_use'\] but no default one"):
        ChatTemplate(path).render(MESSAGES)
