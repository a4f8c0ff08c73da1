"""An agent for Keel's `agent` environment: arithmetic with a calculator tool.

For each sample Keel POSTs {"messages", "metadata", "openai": {"base_url", "api_key",
"model"}, "limits"} (the contract is openapi/agent.json). The agent talks to the policy with
the official `openai` client at that base URL with that key: it offers a `calculator` tool,
runs every call the model makes and sends back the result, until the model answers without
a call (or after --max-turns). It answers Keel with the reward: 1 when the last number of
the answer (or its \\boxed{}) is the record's ground truth, and named rewards `correct` and
`used_calculator`. Keel trains on the tokens the generator sampled under the key, whatever
this program does with the text.

    python3 examples/agent/agent.py --port 8091

With --faults (the test suite's), a record's metadata `fault` makes the agent misbehave:
`error` (answer 500), `timeout` (sleep past the environment's limit), `limit` (call until
the generator refuses) or `fork` (start a second, unrelated conversation).
"""

import argparse
import ast
import json
import operator
import re
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai

SYSTEM = (
    "Solve the problem. You may call the calculator tool with an arithmetic expression; "
    "give the final answer as \\boxed{number}."
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluates an arithmetic expression of integers with + - * / and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate(node):
    """The value of an expression tree of numbers and + - * / only."""
    if isinstance(node, ast.Expression):
        return evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -evaluate(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](evaluate(node.left), evaluate(node.right))
    raise ValueError("only numbers and + - * / are allowed")


def calculator(arguments):
    try:
        expression = json.loads(arguments or "{}").get("expression", "")
        value = evaluate(ast.parse(str(expression)[:200], mode="eval"))
        return str(int(value)) if float(value).is_integer() else str(value)
    except (ValueError, SyntaxError, TypeError, ZeroDivisionError, AttributeError, RecursionError) as e:
        return f"error: {e}"


def final_number(text):
    boxed = re.findall(r"\\boxed\{([^}]*)\}", text or "")
    numbers = re.findall(r"-?\d+", boxed[-1] if boxed else (text or ""))
    return numbers[-1] if numbers else None


def episode(task, max_turns, faults, trace):
    endpoint, metadata = task["openai"], task.get("metadata") or {}
    fault = metadata.get("fault") if faults else None
    if fault == "error":
        raise RuntimeError("this sample's agent fails (fault: error)")
    if fault == "timeout":
        time.sleep(task["limits"]["timeout_seconds"] + 2)
    # The trace context Keel sent goes on with every call, so the calls join the step's trace.
    client = openai.OpenAI(
        base_url=endpoint["base_url"], api_key=endpoint["api_key"], max_retries=0, timeout=120, default_headers=trace
    )
    messages = [{"role": "system", "content": SYSTEM}] + task["messages"]
    calls = tool_uses = 0
    answer = ""
    turns = task["limits"]["max_calls"] + 1 if fault == "limit" else max_turns
    for _ in range(turns):
        try:
            reply = client.chat.completions.create(
                model=endpoint["model"], messages=messages, tools=TOOLS, max_tokens=128
            )
        except openai.BadRequestError as e:
            # A limit of the sample reached: the sample is Keel's to drop; say what happened.
            return {"reward": 0.0, "info": {"calls": calls, "refused": str(e)[:200]}}
        calls += 1
        message = reply.choices[0].message
        if message.tool_calls and fault != "limit":
            messages.append(
                {
                    "role": "assistant",
                    "content": message.content,
                    "tool_calls": [call.model_dump() for call in message.tool_calls],
                }
            )
            for call in message.tool_calls:
                tool_uses += 1
                result = calculator(call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            continue
        answer = message.content or ""
        if fault != "limit":
            break
        messages.append({"role": "assistant", "content": answer})
        messages.append({"role": "user", "content": "Check your answer."})
    if fault == "fork":
        client.chat.completions.create(
            model=endpoint["model"], messages=[{"role": "user", "content": "Something else."}], max_tokens=4
        )
        calls += 1
    correct = 1.0 if final_number(answer) == str(metadata.get("ground_truth")) else 0.0
    used = 1.0 if tool_uses else 0.0
    return {
        "reward": correct,
        "rewards": {"correct": correct, "used_calculator": used},
        "info": {"calls": calls, "tool_calls": tool_uses, "answer": answer[-80:]},
    }


def handler(max_turns, faults):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            try:
                task = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                trace = {name: self.headers[name] for name in ("traceparent", "tracestate") if self.headers.get(name)}
                status, reply = 200, episode(task, max_turns, faults, trace)
            except (ValueError, KeyError, TypeError) as e:
                status, reply = 400, {"error": f"not an agent request: {e}"}
            except Exception as e:  # the agent failed: Keel drops the sample with this reason
                status, reply = 500, {"error": str(e)[:500]}
            payload = json.dumps(reply).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self):
            self.send_response(200 if self.path == "/healthz" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    return Handler


class Server(ThreadingHTTPServer):
    # Keel sends a whole step's samples at once: the default backlog (5) drops connections.
    request_queue_size = 1024
    daemon_threads = True


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8091)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--faults", action="store_true", help="honour metadata.fault (for tests)")
    args = parser.parse_args()
    server = Server((args.host, args.port), handler(args.max_turns, args.faults))
    print(f"agent listening on http://{args.host}:{args.port}", flush=True)
    server.serve_forever()
