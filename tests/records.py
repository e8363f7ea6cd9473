"""Dataset records as the tests write them: a JSONL writer, and a Glaive function-calling chain
(two calls, each with its recorded result) that the prompts and tool-call tests share."""

import json


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GLAIVE_FUNCTIONS = """SYSTEM: You are a helpful assistant with access to the following functions. Use them if required -
{
    "name": "calculate_factorial",
    "description": "Calculate the factorial of a given number",
    "parameters": {
        "type": "object",
        "properties": {
            "number": {
                "type": "integer",
                "description": "The number to calculate factorial for"
            }
        },
        "required": [
            "number"
        ]
    }
}

{
    "name": "get_news_headlines",
    "description": "Get the latest news headlines",
    "parameters": {
        "type": "object",
        "properties": {
            "country": {
                "type": "string"
            }
        }
    }
}
"""
GLAIVE_CHAIN = {
    "system": GLAIVE_FUNCTIONS,
    "chat": "USER: Hi, I need to calculate the factorial of 5. Can you help me with that?\n\n\n"
    'ASSISTANT: <functioncall> {"name": "calculate_factorial", "arguments": \'{"number": 5}\'} <|endoftext|>\n\n\n'
    'FUNCTION RESPONSE: {"result": 120}\n\n\n'
    "ASSISTANT: The factorial of 5 is 120. <|endoftext|>\n\n\n"
    "USER: And the news for the United States?\n\n\n"
    'ASSISTANT: <functioncall> {"name": "get_news_headlines", "arguments": \'{\n'
    '  "country": "United States"\n'
    "}'} <|endoftext|>\n\n\n"
    'FUNCTION RESPONSE: {"headlines": ["A", "B"]}\n\n\n'
    "ASSISTANT: Here are the headlines: A, B. <|endoftext|>\n\n\n"
    "USER: Thanks!\n\n\n"
    "ASSISTANT: You're welcome! <|endoftext|>",
}
