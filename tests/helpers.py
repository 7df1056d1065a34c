"""Small fixtures shared by tests: a byte-level BPE tokenizer trained in memory."""
import functools

DOC = (
    "Acme Corp. reported revenue of $4.2 billion on March 3, 2024, up 12% from a year earlier. "
    "Chief executive Jane K. Doe said the U.S. market drove growth. "
    "Mr. Smith, the finance chief, disagreed. He said costs rose by $300 million. "
    "Shares fell 3.5% in New York. Rival Globex reported revenue of $3.1 billion. "
    "The company employs 3,400 people in 12 countries. aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa!"
)

_CORPUS = [
    DOC,
    'Acme reported revenue of $5 billion.<search>/revenue of/</search><results><0>x</0></results>'
    '<delete scope="sentence"/> Acme reported revenue of $4.2 billion.',
    'Jane Doe said growth came from Europe, not Asia<delete scope="clause"/> from the U.S. market.',
    "<search>Jane Doe growth</search><results><error>empty query</error></results>",
]


@functools.lru_cache(maxsize=None)
def bpe_tokenizer(vocab_size: int = 400):
    """A byte-level BPE (GPT-2 style pre-tokeniser) with merges across markup, so
    tokens straddle text/markup boundaries (".<", "/>") as real vocabularies do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|eot|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eot|>", pad_token="<|pad|>")
    fast.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    return fast
