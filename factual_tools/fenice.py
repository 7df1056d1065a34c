"""FENICE factuality (Scirè et al. 2024): claims extracted from the summary, each aligned to
document passages by an NLI model, the summary's score the mean claim score.

The models load lazily (torch, transformers) on first use; `build_tiny_fenice`
writes tiny NLI and claim models for CPU tests. Selected by `reward.factuality=fenice`.

Where this departs from the reference code (github.com/Babelscape/FENICE), each
stated where it happens: our sentence splitter instead of spaCy's, premises
truncated instead of claims, no-claim summaries get a defined score, caches
bounded and keyed by content instead of by batch position.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import numpy as np


from factual_tools import textsplit
from factual_tools.claims import LRU, text_key


@dataclass
class FeniceConfig:
    claim_model: str = "Babelscape/t5-base-summarization-claim-extractor"  # HF id or local path (seq2seq)
    nli_model: str = "MoritzLaurer/DeBERTa-v3-large-mnli-fever-anli-ling-wanli"  # HF id or path (3-way NLI)
    contrast: Literal["entail_minus_neutral", "entail_minus_contradict"] = "entail_minus_neutral"
    chunk_sentences: int = 5  # sentences per chunk premise (sliding window)
    chunk_stride: int = 1  # sentences between chunk starts
    chunk_level: bool = True  # score claims against chunks (when the document has more than one)
    doc_level: bool = True  # score claims against the whole document (same condition)
    use_coref: bool = False  # coreference-edited premises (needs `fastcoref`)
    claim_batch_size: int = 32  # summaries per claim-extraction generate call
    claim_max_new_tokens: int = 256  # generated tokens per summary's claim list
    nli_batch_size: int = 64  # premise/claim pairs per NLI forward (sentences and chunks)
    nli_max_tokens: int = 1024  # pair length limit for sentence and chunk premises
    doc_batch_size: int = 4  # pairs per NLI forward for whole-document premises
    doc_max_tokens: int = 4096  # pair length limit for the whole-document premise
    device: str = "auto"  # "auto" (cuda if available), "cpu", "cuda", "cuda:1", ...
    half_precision: bool = True  # bf16 (fp16 if bf16 is unsupported) on a GPU; always fp32 on CPU
    cache_documents: int = 256  # documents whose premises and alignments are kept (LRU)
    cache_claims: int = 8192  # summaries whose claims are kept (LRU)
    cache_alignments_per_doc: int = 4096  # claim alignments kept per document



# ---------------------------------------------------------------------------
# FENICE
# ---------------------------------------------------------------------------
# The reference (github.com/Babelscape/FENICE, metric/FENICE.py) per summary:
# claims = the extractor's output split into sentences, de-duplicated; for each
# claim, NLI against every document sentence, every sliding 5-sentence chunk
# (stride 1) and the whole document, the last two only when the document has
# more than one chunk; the claim's score is its best alignment over all of
# them; the summary's score the mean over claims.
#
# The contrast. The reference code scores a pair P(entail) - P(neutral); the
# paper describes P(entail) - P(contradict). We default to the code's: (1) the
# released metric's published numbers come from it, so ours stay comparable;
# (2) under a max over premises, P(entail) - P(contradict) lets any premise the
# claim has nothing to do with (neutral: 0) hide both a contradiction and an
# invented fact, so every non-entailed claim lands near 0.5 after rescaling and
# an invented claim would pass the curriculum's first tau (0.50). With the
# code's contrast an unsupported claim scores near 0. Its known flaw: a
# contradicted claim (0) scores above an unsupported one (-1); both stay far
# below an entailed one. `fenice.contrast` selects the paper's instead. Either
# contrast lies in [-1, 1] and is rescaled by (x + 1) / 2 to [0, 1].

CONTRASTS = ("entail_minus_neutral", "entail_minus_contradict")
_PRONOUNS = frozenset(
    "i me my mine myself you your yours yourself he him his himself she her hers herself it its itself we us "
    "our ours ourselves they them their theirs themselves this that these those who whom whose which what "
    "one ones someone somebody everyone everybody".split())


def alignment_scores(probs: np.ndarray, contrast: str) -> np.ndarray:
    """(N, 3) [entail, neutral, contradict] probabilities -> (N,) alignments in [0, 1]."""
    probs = np.asarray(probs, dtype=np.float64).reshape(-1, 3)
    other = probs[:, 1] if contrast == "entail_minus_neutral" else probs[:, 2]
    return np.clip((probs[:, 0] - other + 1.0) / 2.0, 0.0, 1.0)


def chunk_premises(sentences: Sequence[str], size: int, stride: int) -> list[str]:
    """Sliding windows of `size` sentences, `stride` apart; fewer sentences: one chunk of all."""
    if not sentences:
        return []
    if len(sentences) < size:
        return [" ".join(sentences)]
    return [" ".join(sentences[i:i + size]) for i in range(0, len(sentences) - size + 1, max(1, stride))]


@dataclass
class _FeniceDoc:
    text: str
    spans: list[tuple[int, int]]
    sentences: list[str]
    chunks: list[str]
    alignments: LRU  # claim -> (score, level, premise index)
    clusters: list | None = None  # coreference clusters (character spans), when used

    @property
    def wide(self) -> bool:
        """Chunk and document premises are used only past one chunk (as the reference does)."""
        return len(self.chunks) > 1


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def _label_columns(id2label: dict) -> list[int]:
    """Model output columns of [entailment, neutral, contradiction], read from the
    model's config (label orders differ between NLI checkpoints)."""
    labels = {int(i): str(lab).lower() for i, lab in id2label.items()}
    cols = []
    for want in ("entail", "neutral", "contradict"):
        hit = [i for i, lab in labels.items() if lab.startswith(want)]
        if len(hit) != 1:
            raise ValueError(f"NLI model labels {sorted(labels.values())} do not name entailment, "
                             "neutral and contradiction once each")
        cols.append(hit[0])
    return cols


def _pair_limit(model, tokenizer, wanted: int) -> int:
    """A pair-length limit the model can take: absolute position embeddings cap it;
    relative ones (DeBERTa-v3) do not, which is how the reference reads whole
    documents at 4,096 tokens."""
    c = model.config
    absolute = getattr(c, "position_biased_input", True) and \
        getattr(c, "position_embedding_type", "absolute") == "absolute"
    if not absolute:
        return wanted
    limit = getattr(c, "max_position_embeddings", None) or wanted
    if getattr(c, "model_type", "") in ("roberta", "xlm-roberta", "camembert"):
        limit -= 2  # positions start after the padding index
    return min(wanted, limit)


class Fenice:
    """FENICE, loaded once and fast inside an RL loop.

    Unlike the reference, which loads both models on every `score_batch` call and
    keys its caches by batch position (so nothing is shared between calls), this
    keeps the models, batches claim extraction over the unique summaries of a
    call and NLI over all their (premise, claim) pairs, and caches by content:
    per document (LRU, `cache_documents`) its sentences, chunks and every claim
    alignment computed against it; per summary text its claims (LRU). The G
    rollouts of one document share the document side and any claim they have
    in common.

    NLI cross-encoders read premise and claim together, so no premise encoding
    can be reused across claims; what is reused is everything document-side
    that does not involve the claim.

    `nli_fn(pairs) -> (N, 3)` [entail, neutral, contradict] probabilities,
    `claim_fn(summaries) -> list of generated claim texts` and `coref_fn(text)
    -> clusters` replace the models (tests, other backends).
    """

    def __init__(self, cfg: FeniceConfig | None = None, nli_fn: Callable | None = None,
                 claim_fn: Callable | None = None, coref_fn: Callable | None = None):
        self.cfg = cfg or FeniceConfig()
        if self.cfg.contrast not in CONTRASTS:
            raise ValueError(f"fenice.contrast must be one of {CONTRASTS}, got {self.cfg.contrast!r}")
        self._nli_fn, self._claim_fn, self._coref_fn = nli_fn, claim_fn, coref_fn
        self._hf_nli: Callable | None = None  # (pairs, max_tokens, batch_size) -> probs, when no nli_fn
        self.docs = LRU(self.cfg.cache_documents)
        self.claims = LRU(self.cfg.cache_claims)
        self.stats: collections.Counter = collections.Counter()  # pairs, summaries extracted, cache hits

    def clear_caches(self) -> None:
        self.docs.clear()
        self.claims.clear()

    # -- models (loaded on first use) --------------------------------------

    def _load_nli(self):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        device = _device(self.cfg.device)
        dtype = torch.float32
        if device.startswith("cuda") and self.cfg.half_precision:
            dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        tok = AutoTokenizer.from_pretrained(self.cfg.nli_model)
        model = AutoModelForSequenceClassification.from_pretrained(self.cfg.nli_model, dtype=dtype)
        model.to(device).eval()
        cols = _label_columns(model.config.id2label)
        limits = {self.cfg.nli_max_tokens: _pair_limit(model, tok, self.cfg.nli_max_tokens),
                  self.cfg.doc_max_tokens: _pair_limit(model, tok, self.cfg.doc_max_tokens)}

        def nli(pairs, max_tokens, batch_size):
            out = np.zeros((len(pairs), 3))
            # Longest first: similar lengths share a batch (little padding), and an
            # out-of-memory batch fails at once rather than at the end.
            order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
            limit = limits.get(max_tokens, max_tokens)
            for k in range(0, len(order), batch_size):
                idx = order[k:k + batch_size]
                prem, hyp = [pairs[i][0] for i in idx], [pairs[i][1] for i in idx]
                # The premise is truncated, never the claim: a cut claim is another
                # claim. (The reference truncates the longer of the two.)
                try:
                    enc = tok(prem, hyp, padding=True, truncation="only_first", max_length=limit,
                              return_tensors="pt")
                except Exception:  # a claim longer than the limit on its own
                    enc = tok(prem, hyp, padding=True, truncation="longest_first", max_length=limit,
                              return_tensors="pt")
                enc = {k2: v.to(device) for k2, v in enc.items()}
                with torch.inference_mode():
                    logits = model(**enc).logits.float()
                out[idx] = torch.softmax(logits, dim=-1)[:, cols].cpu().numpy()
            return out

        return nli

    def _load_extractor(self):
        import torch
        from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

        device = _device(self.cfg.device)
        dtype = torch.float32
        # T5 overflows in fp16; it runs in bf16 where the GPU has it, else fp32.
        if device.startswith("cuda") and self.cfg.half_precision and torch.cuda.is_bf16_supported():
            dtype = torch.bfloat16
        tok = AutoTokenizer.from_pretrained(self.cfg.claim_model)
        model = AutoModelForSeq2SeqLM.from_pretrained(self.cfg.claim_model, dtype=dtype)
        model.to(device).eval()

        def extract(summaries):
            out = []
            for k in range(0, len(summaries), self.cfg.claim_batch_size):
                batch = list(summaries[k:k + self.cfg.claim_batch_size])
                enc = tok(batch, padding=True, truncation=True, max_length=512, return_tensors="pt").to(device)
                with torch.inference_mode():
                    # Greedy (no sampling): a reward must not be random.
                    gen = model.generate(**enc, max_new_tokens=self.cfg.claim_max_new_tokens, do_sample=False)
                out += tok.batch_decode(gen, skip_special_tokens=True)
            return out

        return extract

    def _load_coref(self):
        try:
            from fastcoref import FCoref
        except ImportError:
            raise ImportError("fenice.use_coref=true needs fastcoref: pip install fastcoref") from None
        model = FCoref(device=_device(self.cfg.device), enable_progress_bar=False)
        return lambda text: model.predict(texts=[text])[0].get_clusters(as_strings=False)

    def nli(self, pairs: list[tuple[str, str]], max_tokens: int, batch_size: int) -> np.ndarray:
        if not pairs:
            return np.zeros((0, 3))
        self.stats["nli_pairs"] += len(pairs)
        if self._nli_fn is not None:
            return np.asarray(self._nli_fn(pairs), dtype=np.float64).reshape(-1, 3)
        if self._hf_nli is None:
            self._hf_nli = self._load_nli()
        return np.asarray(self._hf_nli(pairs, max_tokens, batch_size), dtype=np.float64).reshape(-1, 3)

    # -- document and summary sides ------------------------------------------

    def _doc(self, text: str) -> _FeniceDoc:
        key = text_key(text)
        doc = self.docs.get(key)
        if doc is None:
            # Deviation: sentences come from textsplit.split_sentences (the splitter
            # the search tool uses) rather than spaCy's; the chunks follow.
            spans = textsplit.sentence_spans(text)
            sents = [text[a:b] for a, b in spans]
            doc = _FeniceDoc(text, spans, sents, chunk_premises(sents, self.cfg.chunk_sentences,
                                                                  self.cfg.chunk_stride),
                             LRU(self.cfg.cache_alignments_per_doc))
            self.docs.put(key, doc)
        else:
            self.stats["doc_hits"] += 1
        return doc

    def claims_of(self, summaries: Sequence[str]) -> list[list[str]]:
        """Claims per summary: the extractor's output split into sentences and
        de-duplicated, as in the reference. Deviations: a summary for which the
        extractor yields nothing is scored on its own sentences (the reference
        falls back to the whole summary only for a cache miss, and gives NaN for
        an empty claim list); a summary with no words has no claims."""
        out: dict[str, list[str]] = {}
        todo = []
        for s in dict.fromkeys(summaries):
            cached = self.claims.get(s)
            if cached is not None:
                out[s] = cached
                self.stats["claim_hits"] += 1
            elif not textsplit.words(s):
                out[s] = []
            else:
                todo.append(s)
        if todo:
            if self._claim_fn is None:
                self._claim_fn = self._load_extractor()
            self.stats["summaries_extracted"] += len(todo)
            for s, generated in zip(todo, self._claim_fn(todo)):
                claims = list(dict.fromkeys(c.strip() for c in textsplit.split_sentences(generated or "")
                                            if textsplit.words(c)))
                out[s] = claims or [c for c in textsplit.split_sentences(s) if textsplit.words(c)]
                self.claims.put(s, out[s])
        return [out[s] for s in summaries]

    # -- alignment ---------------------------------------------------------

    def _coref_variants(self, doc: _FeniceDoc, i: int) -> list[str]:
        """Versions of sentence i with a mention replaced by another, non-pronoun
        mention of its coreference cluster ("She said ..." -> "Jane Doe said ...")."""
        if doc.clusters is None:
            if self._coref_fn is None:
                self._coref_fn = self._load_coref()
            doc.clusters = [list(map(tuple, c)) for c in self._coref_fn(doc.text)]
        a, b = doc.spans[i]
        sentence = doc.text[a:b]
        out = set()
        for cluster in doc.clusters:
            inside = [(x, y) for x, y in cluster if a <= x and y <= b]
            if not inside:
                continue
            here = {doc.text[x:y] for x, y in inside}
            others = {doc.text[x:y] for x, y in cluster} - here
            others = {o for o in others if o.lower() not in _PRONOUNS}
            for x, y in inside:
                for o in sorted(others):
                    out.add(sentence[:x - a] + o + sentence[y - a:])
        return sorted(out)

    def _align(self, pending: list[tuple[_FeniceDoc, str]]) -> list[tuple[float, str, int]]:
        """Best (score, level, premise index) of each (document, claim)."""
        cfg = self.cfg
        pairs, owners, dpairs, downers = [], [], [], []
        for k, (doc, claim) in enumerate(pending):
            for i, s in enumerate(doc.sentences):
                pairs.append((s, claim))
                owners.append((k, "sentence", i))
            if doc.wide and cfg.chunk_level:
                for i, c in enumerate(doc.chunks):
                    pairs.append((c, claim))
                    owners.append((k, "chunk", i))
            if doc.wide and cfg.doc_level:
                dpairs.append((doc.text, claim))
                downers.append((k, "document", 0))
        best: list[tuple[float, str, int]] = [(0.0, "none", -1)] * len(pending)
        best_sentence = [(-1.0, -1)] * len(pending)
        for ps, os_, limit, bs in ((pairs, owners, cfg.nli_max_tokens, cfg.nli_batch_size),
                                   (dpairs, downers, cfg.doc_max_tokens, cfg.doc_batch_size)):
            scores = alignment_scores(self.nli(ps, limit, bs), cfg.contrast)
            for (k, level, i), sc in zip(os_, scores):
                if sc > best[k][0] or best[k][2] < 0:
                    best[k] = (float(sc), level, i)
                if level == "sentence" and sc > best_sentence[k][0]:
                    best_sentence[k] = (float(sc), i)
        if cfg.use_coref:
            cpairs, cowners = [], []
            for k, (doc, claim) in enumerate(pending):
                if best_sentence[k][1] >= 0:
                    for j, v in enumerate(self._coref_variants(doc, best_sentence[k][1])):
                        cpairs.append((v, claim))
                        cowners.append((k, v))
            scores = alignment_scores(self.nli(cpairs, cfg.nli_max_tokens, cfg.nli_batch_size), cfg.contrast)
            for (k, v), sc in zip(cowners, scores):
                if sc > best[k][0]:
                    best[k] = (float(sc), "coref:" + v, best_sentence[k][1])
        return best

    def score_batch(self, pairs: Sequence[tuple[str, str]]) -> list[dict]:
        """[(document text, summary text)] -> [{"score", "claims": [{claim, score, level, premise}]}]."""
        docs = [self._doc(d) for d, _ in pairs]
        claims = self.claims_of([s for _, s in pairs])
        todo: dict[tuple[int, str], tuple[_FeniceDoc, str]] = {}
        for doc, cl in zip(docs, claims):
            for c in cl:
                if c in doc.alignments:
                    self.stats["alignment_hits"] += 1
                else:
                    todo.setdefault((id(doc), c), (doc, c))
        fresh = dict(zip(todo, self._align(list(todo.values()))))
        for (_, c), (doc, _) in zip(fresh, todo.values()):
            doc.alignments.put(c, fresh[(id(doc), c)])
        out = []
        for doc, cl in zip(docs, claims):
            rows = []
            for c in cl:
                sc, level, i = fresh.get((id(doc), c)) or doc.alignments.get(c)
                if level.startswith("coref:"):
                    premise, level = level[len("coref:"):], "coref"
                else:
                    premise = {"sentence": doc.sentences, "chunk": doc.chunks}.get(level, [doc.text])[i] \
                        if i >= 0 else ""
                rows.append({"claim": c, "score": sc, "level": level, "premise": premise})
            # No claims (no words): 0, defined, never NaN; nothing was stated.
            score = float(np.mean([r["score"] for r in rows])) if rows else 0.0
            out.append({"score": score, "claims": rows})
        return out


_TINY_CORPUS = (
    "Acme Corp. reported revenue of $4.2 billion on March 3, 2024, up 12% from a year earlier. "
    "Chief executive Jane K. Doe said the U.S. market drove growth. Shares fell 3.5% in New York. "
    "Rival Globex reported revenue of $3.1 billion. The company employs 3,400 people in 12 countries. "
    "The council approved a plan for a new rail line. The court ruled against the firm in a patent case.")


def build_tiny_fenice(out_dir: str, nli_arch: Literal["deberta-v2", "bert"] = "deberta-v2",
                      id2label: dict[int, str] | None = None, seed: int = 0,
                      texts: Sequence[str] = (), vocab_size: int = 4000) -> FeniceConfig:
    """Save a randomly initialised claim extractor (T5) and NLI classifier, with
    byte-level BPE tokenizers trained on `texts`, under `out_dir`, and return a
    FeniceConfig that uses them on the CPU. For tests and benchmarks: it runs
    the real loading, batching and caching code without a network; its scores
    mean nothing. `id2label` defaults to a non-standard order, so a caller that
    assumes one is caught. Trained on a few documents, the default vocabulary
    cuts news text into ~1.3 tokens a word, as the real models' vocabularies
    do, so sequence lengths (and what batching can save) are realistic."""
    import os

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import (BertConfig, BertForSequenceClassification, DebertaV2Config,
                              DebertaV2ForSequenceClassification, PreTrainedTokenizerFast, T5Config,
                              T5ForConditionalGeneration)

    def bpe(specials: list[str], template: Callable) -> Tokenizer:
        tok = Tokenizer(models.BPE(unk_token=specials[-1]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator([_TINY_CORPUS, *texts] * 4, trainer)
        tok.post_processor = template(tok)
        return tok

    torch.manual_seed(seed)
    claims_dir, nli_dir = os.path.join(out_dir, "claims"), os.path.join(out_dir, "nli")
    t5tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe(["<pad>", "</s>", "<unk>"], lambda t: processors.TemplateProcessing(
            single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)])),
        pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    t5 = T5ForConditionalGeneration(T5Config(
        vocab_size=len(t5tok), d_model=32, d_ff=64, d_kv=8, num_layers=2, num_decoder_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    t5.save_pretrained(claims_dir)
    t5tok.save_pretrained(claims_dir)
    nlitok = PreTrainedTokenizerFast(
        tokenizer_object=bpe(["[PAD]", "[CLS]", "[SEP]", "[UNK]"], lambda t: processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", 1), ("[SEP]", 2)])),
        pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]", unk_token="[UNK]")
    id2label = id2label or {0: "CONTRADICTION", 1: "ENTAILMENT", 2: "NEUTRAL"}
    common = dict(vocab_size=len(nlitok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, num_labels=len(id2label), id2label=id2label,
                  label2id={v: k for k, v in id2label.items()}, pad_token_id=0)
    if nli_arch == "bert":
        nli = BertForSequenceClassification(BertConfig(max_position_embeddings=128, **common))
    else:  # the reference NLI model's family: relative positions, any length
        nli = DebertaV2ForSequenceClassification(DebertaV2Config(
            relative_attention=True, position_biased_input=False, pos_att_type=["p2c", "c2p"],
            max_relative_positions=64, type_vocab_size=0, **common))
    nli.save_pretrained(nli_dir)
    nlitok.save_pretrained(nli_dir)
    return FeniceConfig(claim_model=claims_dir, nli_model=nli_dir, device="cpu", claim_max_new_tokens=16,
                        nli_max_tokens=256, doc_max_tokens=1024)


