"""The offline LLM's entry points built on `generate` (vLLM's): chat through the model's
template, embeddings, classes and scores (the pooling APIs), and beam search. LLM (llm.py)
holds the engine and `generate`; this class is its other half."""

from __future__ import annotations

from collections.abc import Sequence

from tqdm import tqdm

from llmbus.chat_images import take_images
from llmbus.inputs import Prompt, TokensPrompt, is_one_prompt, parse_prompt
from llmbus.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from shared.lora_request import LoRARequest
from shared.messages import PromptWithImages
from shared.processing.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, advance_each, step_batch
from shared.processing.scoring import cosine, pair_token_ids, score_pairs
from shared.sampling_params import SamplingParams, embedding_params


class GenerateBasedAPIs:
    # (provided by LLM: generate, tokenizer, classifier, unsupported_pooling, eos_token_id, runner)

    def score(self, text_1: Prompt | Sequence[Prompt], text_2: Prompt | Sequence[Prompt], use_tqdm: bool = False,
              lora_request: LoRARequest | None = None) -> list[ScoringRequestOutput]:
        """vLLM's: each pair's score (one text_1 against every text_2, or text_1[i] against
        text_2[i]): from an embedding model the cosine similarity of the two texts'
        embeddings, each distinct text embedded once; from a cross-encoder (a classifier of
        one label) its output on the pair encoded together."""
        texts, pairs = score_pairs(text_1, text_2, limit=1 << 30)
        if self.classifier is not None:
            if not self.classifier.cross_encoder:
                raise ValueError(f"a classifier of {len(self.classifier.labels)} labels does not score pairs "
                                 "(a cross-encoder has one): LLM.classify")
            together = [pair_token_ids(self.tokenizer.hf, texts[a], texts[b]) for a, b in pairs]
            results = self.generate(together, embedding_params(), use_tqdm=use_tqdm, lora_request=lora_request)
            return [ScoringRequestOutput(r.request_id, ScoringOutput(self.classifier.probabilities(r.embedding)[0]),
                                         r.prompt_token_ids) for r in results]
        embedded = self.embed(texts, use_tqdm=use_tqdm, lora_request=lora_request)
        return [ScoringRequestOutput(f"{embedded[a].request_id}_{embedded[b].request_id}",
                                     ScoringOutput(cosine(embedded[a].outputs.embedding, embedded[b].outputs.embedding)),
                                     embedded[a].prompt_token_ids + embedded[b].prompt_token_ids)
                for a, b in pairs]

    def embed(self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool = False,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[EmbeddingRequestOutput]:
        """vLLM's: each prompt's embedding, the model's final hidden state at its last
        token, L2-normalized (last-token pooling, as decoder embedding models such as
        Qwen3-Embedding and e5-mistral are trained for)."""
        if self.unsupported_pooling is not None:
            raise ValueError(self.unsupported_pooling)
        if self.classifier is not None:
            raise ValueError("this model is a sequence classifier: LLM.classify (served: /classify), not embeddings")
        results = self.generate(prompts, embedding_params(), use_tqdm=use_tqdm, lora_request=lora_request)
        return [EmbeddingRequestOutput(r.request_id, r.prompt_token_ids, EmbeddingOutput(r.embedding)) for r in results]

    def classify(self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool = False,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[ClassificationRequestOutput]:
        """vLLM's, for a sequence classifier (`*ForSequenceClassification`): each prompt's
        class probabilities, from its score head at the prompt's last token."""
        if self.classifier is None:
            raise ValueError("this model is not a sequence classifier (no *ForSequenceClassification in its config)")
        results = self.generate(prompts, embedding_params(), use_tqdm=use_tqdm, lora_request=lora_request)
        return [ClassificationRequestOutput(r.request_id, r.prompt_token_ids,
                                            ClassificationOutput(self.classifier.probabilities(r.embedding)))
                for r in results]

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams,
                    lora_request: LoRARequest | None = None, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's: each prompt's `beam_width` best beams (shared/processing/beam_search.py), every beam
        of every prompt a request of each step's batch; a sequence's `tokens` are the
        prompt's and its own, its `text` all of them decoded (as vLLM's)."""
        if is_one_prompt(prompts):
            prompts = [prompts]  # type: ignore[list-item]
        searches = []
        for prompt in prompts:  # type: ignore[union-attr]
            parsed = parse_prompt(prompt)
            token_ids = parsed.token_ids if parsed.token_ids is not None else self.tokenizer.encode(parsed.text)
            searches.append(BeamSearch(token_ids, params, self.eos_token_id, self.runner.max_model_len))
        step = params.step_params()
        with tqdm(total=params.max_tokens, disable=not use_tqdm, desc="beam search", unit="token") as bar:
            while (batch := step_batch(searches))[0]:
                live, prompts = batch
                results = self.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], step,
                                        lora_request=lora_request)
                advance_each(live, [r.outputs[0].logprobs[0] if r.outputs[0].logprobs else None for r in results])
                bar.update(1)
        answers = []
        for search in searches:
            best = search.best()
            for beam in best:
                beam.text = self.tokenizer.decode(beam.tokens, skip_special_tokens=False)
            answers.append(BeamSearchOutput(best))
        return answers

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
        chat_template_content_format: str = "auto",
    ) -> list[RequestOutput]:
        """vLLM's: `continue_final_message` goes on from a last assistant message (with
        add_generation_prompt=False); `chat_template_kwargs` are the template's own
        variables (Qwen3's enable_thinking); `chat_template`, a Jinja template's text, in
        place of the model's; `tools`, OpenAI's function tools, shown to the model as the
        served chat shows them (the output is the model's text: calls are not parsed).
        Messages are OpenAI's, as served: content a string or parts - text, and images
        (`image_url` with a data: or http(s): URL, or vLLM's `image_pil`) where the model
        takes them (chat_images.py). `chat_template_content_format`: "string" or "auto", as
        the flag (services/tokenizer/tokenizer.py's render_chat)."""
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(f"chat_template_content_format={chat_template_content_format!r}: auto or string")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        texts, prompts = [], []
        for conv in conversations:  # type: ignore[union-attr]
            conv, images = take_images(conv)
            image_prompts = self._image_prompts() if images else None  # (a model that takes none says so here)
            text = self.tokenizer.render_chat(conv, add_generation_prompt, tools, continue_final_message,
                                              chat_template_kwargs, chat_template,
                                              content_format=chat_template_content_format)
            texts.append(text)
            # Token ids, as the template rendered them (its special tokens its own: no BOS added)
            prompts.append(PromptWithImages(*image_prompts.encode(text, images, add_special_tokens=False))
                           if image_prompts else self.tokenizer.encode(text, add_special_tokens=False))
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        for out, text in zip(outputs, texts):
            out.prompt = text  # (vLLM's: the rendered conversation)
        return outputs
