"""Chat messages as vLLM passes them to the model's template: developer and tool roles, assistant
tool calls with null content, and the tools when tool_choice is "none" (stories260K as a Hugging
Face folder with a template that shows what it was given)."""

import pytest

from conftest import stories_hf_server

# Writes every field it is given; refuses a tool message without a tool_call_id.
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' and not m.tool_call_id %}{{ raise_exception('Tool results need a tool_call_id') }}{% endif %}"
    "{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls %} call {{ c.id }} {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}"
    "{% if m.tool_call_id %} result of {{ m.tool_call_id }}{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory):
    yield from stories_hf_server(tmp_path_factory, TOOLS_TEMPLATE, "stories-hf-tools")


def same_as_prompt(server, chat_body, prompt):
    """The chat request rendered exactly `prompt` (after the BOS the template writes): the same
    prompt tokens and the same greedy answer as that text sent to /v1/completions."""
    r = server.post("/v1/chat/completions", dict(chat_body, max_tokens=6, temperature=0))
    assert r.status_code == 200, r.text
    c = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0})
    assert c.status_code == 200, c.text
    assert r.json()["usage"]["prompt_tokens"] == c.json()["usage"]["prompt_tokens"]
    assert r.json()["choices"][0]["message"]["content"] == c.json()["choices"][0]["text"]


CONVERSATION = [
    {"role": "developer", "content": "Answer briefly."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
]
RENDERED = ("developer: Answer briefly.\nuser: Weather in Paris?\n"
            "assistant:  call call_1 get_weather {\"city\": \"Paris\"}\ntool: Sunny result of call_1\nassistant:")


def test_developer_tool_and_tool_call_messages_reach_the_template(tools_server):
    """Each of these was a 400 (roles developer and tool, content null)."""
    same_as_prompt(tools_server, {"messages": CONVERSATION}, RENDERED)
    # The official client sends the same shapes.
    client = tools_server.openai()
    r = client.chat.completions.create(model="stories-hf-tools", messages=CONVERSATION, max_tokens=3)
    assert r.usage.completion_tokens == 3


def test_tool_choice_none_renders_the_tools(tools_server):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "get_time"}}]
    same_as_prompt(tools_server, {"messages": CONVERSATION, "tools": tools, "tool_choice": "none"},
                   "tools: get_weather get_time\n" + RENDERED)
    r = tools_server.post("/v1/chat/completions", {"messages": CONVERSATION, "tools": tools, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def test_a_role_the_template_refuses_is_a_400_with_its_message(tools_server):
    body = {"messages": [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "Sunny"}], "max_tokens": 2}
    r = tools_server.post("/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages"
    assert "Tool results need a tool_call_id" in r.json()["error"]["message"]
    r = tools_server.post("/v1/chat/completions", dict(body, stream=True))
    assert r.status_code == 400 and "tool_call_id" in r.json()["error"]["message"]
    assert tools_server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                      "max_tokens": 2}).status_code == 200
