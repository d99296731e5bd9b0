"""A teacher of another tokenizer and chat template (tasks/modeling/alignment.py, tasks/modeling/aligned.py): the
shipped SmolLM2 tokenizer (byte-level BPE, digits split one by one, ChatML) as the student's, and
tests/data/other-tokenizer (SentencePiece-style BPE with byte fallback, multi-digit numerals, a Gemma-like template;
built by tests/data/make_other_tokenizer.py) as the teacher's. Unit tests of the byte alignment on awkward text,
the aligned signal against an independent brute-force computation, and the registration rules; an end-to-end merge
of a tiny random student with an aligned teacher beside a same-tokenizer one lives in test_aligned_merge_e2e.py."""

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tasks.modeling.alignment import (SortedVocab, align, decodable, digit_ids, stop_id, token_bytes, turn_end_text,
                                      vocab_map)
from tests.tiny import tiny_llama

DATA = Path(__file__).parent / "data"
AWKWARD = ["12345", " 17 + 25 = 42", "  hello   world\n\tend", "héllo naïve 日本 🙂", "The answer is 42.",
           "sort: 3 1 2 -> 1 2 3", ""]


@pytest.fixture(scope="module")
def toks():
    from transformers import AutoTokenizer

    return (AutoTokenizer.from_pretrained(DATA / "smollm2-tokenizer"),
            AutoTokenizer.from_pretrained(DATA / "other-tokenizer"))


@pytest.mark.parametrize("text", AWKWARD)
def test_both_tokenizers_spell_the_text_back_byte_for_byte(toks, text):
    for tok in toks:
        table = token_bytes(tok)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert b"".join(table[i] for i in ids) == text.encode(), tok.name_or_path


def test_token_bytes_reads_each_family_its_own_way(toks):
    student, teacher = toks
    s, t = token_bytes(student), token_bytes(teacher)
    assert s[student.convert_tokens_to_ids("Ġhello")] == b" hello"  # GPT-2's alphabet: Ġ is a space
    assert s[student.convert_tokens_to_ids("Ã©")] == "é".encode()
    assert t[teacher.convert_tokens_to_ids("▁world")] == b" world"  # SentencePiece: ▁ is a space
    assert t[teacher.convert_tokens_to_ids("<0xC3>")] == b"\xc3"  # byte fallback
    assert s[student.eos_token_id] is None and t[teacher.convert_tokens_to_ids("<end_of_turn>")] is None


def test_the_shared_vocabulary_maps_equal_bytes_and_each_teacher_token_once(toks):
    student, teacher = toks
    s, t = token_bytes(student), token_bytes(teacher)
    m = vocab_map(s, t)
    assert len(m) == len(student)
    shared = [i for i, j in enumerate(m) if j >= 0]
    assert all(s[i] == t[m[i]] for i in shared)
    assert len({m[i] for i in shared}) == len(shared)  # injective: a mapped distribution counts no mass twice
    assert m[student.convert_tokens_to_ids("1")] == teacher.convert_tokens_to_ids("1")
    assert m[student.eos_token_id] == -1  # specials are the caller's to map


def test_a_text_several_teacher_ids_stand_for_maps_onto_the_one_the_teacher_writes(toks):
    from tasks.modeling.alignment import canonical_ids, same_bytes

    student, teacher = toks
    t = token_bytes(teacher)
    groups = same_bytes(t)
    piece, byte = teacher.convert_tokens_to_ids("7"), teacher.convert_tokens_to_ids("<0x37>")
    assert sorted(groups[b"7"]) == sorted([piece, byte])
    # Whatever the id order (Gemma puts its byte-fallback tokens first), the piece the tokenizer writes wins.
    assert canonical_ids(teacher, {b"7": [byte, piece]}) == {b"7": piece}
    reversed_table = list(t)
    m = vocab_map(token_bytes(student), reversed_table, canonical_ids(teacher, groups))
    assert m[student.convert_tokens_to_ids("7")] == piece
    assert all(teacher(b.decode(), add_special_tokens=False)["input_ids"] == [c]
               for b, c in canonical_ids(teacher, groups).items() if b.isascii() and b.isalnum())


def test_alignment_of_a_digit_splitting_student_under_multi_digit_teacher_tokens(toks):
    student, teacher = toks
    s, t = token_bytes(student), token_bytes(teacher)
    sp = [s[i] for i in student("12345", add_special_tokens=False)["input_ids"]]
    tp = [t[i] for i in teacher("12345", add_special_tokens=False)["input_ids"]]
    assert sp == [b"1", b"2", b"3", b"4", b"5"] and tp == [b"123", b"45"]
    recipes = align(sp, tp)
    # '1' and '2' cut teacher token 0 inside (prefix masses), '3' ends it, '4' cuts token 1, '5' ends it.
    assert [(r.start.token, r.start.prefix, r.end.token, r.end.prefix) for r in recipes] == [
        (0, b"", 0, b"1"), (0, b"1", 0, b"12"), (0, b"12", 1, b""), (1, b"", 1, b"4"), (1, b"4", 2, b"")]
    assert all(r.one_to_one == -1 for r in recipes)


def test_alignment_of_one_student_token_over_several_teacher_tokens_and_one_to_one_tokens(toks):
    student, teacher = toks
    s, t = token_bytes(student), token_bytes(teacher)
    sp = [s[i] for i in student("  hello world", add_special_tokens=False)["input_ids"]]
    tp = [t[i] for i in teacher("  hello world", add_special_tokens=False)["input_ids"]]
    assert sp == [b" ", b" hello", b" world"] and tp == [b" ", b" ", b"hello", b" world"]
    recipes = align(sp, tp)
    assert [r.one_to_one for r in recipes] == [0, -1, 3]
    assert (recipes[1].start.token, recipes[1].end.token) == (1, 3)  # ' hello' = teacher tokens 1 and 2, summed
    with pytest.raises(ValueError, match="same bytes"):
        align(sp, tp[:-1])


def test_a_response_cut_inside_a_character_is_read_up_to_it():
    assert decodable("héllo".encode()) == ("héllo", 6)
    assert decodable("hé".encode()[:-1]) == ("h", 1)
    assert decodable(b"ab\xffcd") == ("ab", 2)


def test_prefix_ranges_hold_exactly_the_tokens_starting_with_the_prefix(toks):
    t = token_bytes(toks[1])
    vocab = SortedVocab.of(t)
    for prefix in (b"1", b"12", b" w", b"The", b"\xc3", b"zzzz"):
        lo, hi = vocab.prefix_range(prefix)
        assert sorted(vocab.ids[lo:hi]) == sorted(i for i, b in enumerate(t) if b and b.startswith(prefix))


def test_each_template_says_how_its_turn_ends(toks):
    student, teacher = toks
    assert turn_end_text(student) == "<|im_end|>" and stop_id(student) == student.eos_token_id
    assert turn_end_text(teacher) == "<end_of_turn>"
    assert stop_id(teacher) == teacher.convert_tokens_to_ids("<end_of_turn>") != teacher.eos_token_id
    digits = set(digit_ids(student))
    assert student.convert_tokens_to_ids("7") in digits and student.convert_tokens_to_ids("Ġhello") not in digits


# ---------------------------------------------------------------------------------------------- the aligned signal


MESSAGES = [{"role": "system", "content": "Answer with the final answer only."},
            {"role": "user", "content": "What is 17 + 25?"}]
RESPONSES = ["The answer is 42.", "  12345 naïve", "h\u00e9"]  # the last one is cut inside 'é' below (its lead byte)


@pytest.fixture(scope="module")
def scored(toks):
    """An aligned teacher's scores of three student responses (both objective kinds), and what it read."""
    from tasks.modeling.aligned import AlignedTeacher
    from tasks.modeling.rollout import rollout_from_responses
    from tasks.modeling.teacher import TeacherBatch
    from tasks.specs.render import RowText

    student, teacher_tok = toks
    model = tiny_llama(teacher_tok, 1, 512).eval()
    aligned = AlignedTeacher("other", {"other": model}, teacher_tok, student)
    prompt = student.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    texts = [RowText.of("r", prompt, MESSAGES)] * len(RESPONSES)
    responses = [student(r, add_special_tokens=False)["input_ids"] for r in RESPONSES]
    responses = [responses[0] + [student.eos_token_id], responses[1] + [student.eos_token_id],
                 responses[2][:-1] + [student.convert_tokens_to_ids("Ã")]]  # 'h', then the byte 0xC3 alone
    rollout = rollout_from_responses(student, [prompt] * len(RESPONSES), responses)
    token = aligned.score(TeacherBatch(rollout, [0, 1, 2], 1, student, texts))
    full = aligned.score(TeacherBatch(rollout, [0, 1, 2], -1, student, texts))
    return aligned, model, rollout, responses, token, full


def brute_force_logps(model, teacher_tok, response: str, ended: bool, student_pieces: list[bytes]) -> list[float]:
    """The teacher's log-probability of each student token's bytes, computed the slow way: its own rendering, its
    distribution at every position, and the mass on tokens starting with a prefix summed over the whole vocabulary
    token by token."""
    table = token_bytes(teacher_tok)
    prompt_ids = teacher_tok(teacher_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
                             add_special_tokens=False)["input_ids"]
    resp_ids = teacher_tok(response, add_special_tokens=False)["input_ids"]
    end_id = teacher_tok.convert_tokens_to_ids("<end_of_turn>")
    ids = prompt_ids + resp_ids + [end_id]
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    dist = [logp[len(prompt_ids) - 1 + i] for i in range(len(resp_ids) + 1)]  # predicting teacher token i

    def log_prefix_prob(x: int) -> float:  # log P(the teacher's text starts with the response's first x bytes)
        total, pos = 0.0, 0
        if x == 0:  # the empty prefix: certain
            return total
        for i, tid in enumerate(resp_ids):
            piece = table[tid]
            if pos + len(piece) <= x:
                total += float(dist[i][tid])
                pos += len(piece)
                if pos == x:
                    return total
            else:
                prefix = response.encode()[pos:x]
                mass = sum(math.exp(float(dist[i][v])) for v, b in enumerate(table) if b and b.startswith(prefix))
                return total + math.log(mass)
        return total

    out, x = [], 0
    for piece in student_pieces:
        out.append(log_prefix_prob(x + len(piece)) - log_prefix_prob(x))
        x += len(piece)
    if ended:
        out.append(float(dist[len(resp_ids)][end_id]))
    return out


def head_values(score, rollout, row_k: int):
    """What the update reads from a score at row ``row_k``'s response positions: log-probs of the student's token."""
    P = rollout.prompt_width
    with torch.no_grad():
        logp_T_V = F.log_softmax(score.head(score.features_b_T_F[row_k]).float(), -1)
    targets = rollout.sequences_B_T[score.rows[row_k], 1:]
    return [float(logp_T_V[t, targets[t]]) for t in range(P - 1, rollout.sequences_B_T.shape[1] - 1)]


def test_the_sampled_token_signal_equals_a_brute_force_computation(toks, scored):
    student, teacher_tok = toks
    _, model, rollout, responses, token, _ = scored
    table = token_bytes(student)
    for k in (0, 1):
        body = responses[k][:-1]
        expected = brute_force_logps(model, teacher_tok, RESPONSES[k], True, [table[i] for i in body])
        got = head_values(token, rollout, k)[:len(expected)]
        assert got == pytest.approx(expected, abs=2e-4)
        assert all(v <= 1e-6 for v in got)
        P = rollout.prompt_width
        assert token.signal_b_T[k, P - 1:P - 1 + len(expected)].tolist() == [1] * len(expected)
        assert token.signal_b_T[k, :P - 1].sum() == 0  # prompt positions carry nothing


def test_a_response_cut_inside_a_character_masks_only_the_unreadable_token(toks, scored):
    student, _ = toks
    _, _, rollout, responses, token, full = scored
    P = rollout.prompt_width
    assert [student.convert_ids_to_tokens(i) for i in responses[2]] == ["h", "Ã"]
    assert token.signal_b_T[2, P - 1:P + 1].tolist() == [1, 0]  # 'h' read; half of 'é' is not; no EOS
    assert token.signal_b_T[2].sum() == 1


def test_full_distributions_sit_on_teacher_boundaries_over_the_shared_vocabulary(toks, scored):
    student, teacher_tok = toks
    aligned, model, rollout, responses, token, full = scored
    P = rollout.prompt_width
    recipes = align([token_bytes(student)[i] for i in responses[0][:-1]],
                    [token_bytes(teacher_tok)[i] for i in teacher_tok(RESPONSES[0], add_special_tokens=False)["input_ids"]])
    # Distributions where the context ends on a teacher boundary ('The' and '2': the starts of 'The answer is 4' and
    # '2.'), and at the EOS; not inside a teacher token (' answer', ' is', ' ', '4', '.').
    on_boundary = [j for j, r in enumerate(recipes) if not r.start.prefix] + [len(recipes)]
    assert on_boundary == [0, 5, 7]
    assert full.signal_b_T[0, P - 1:].nonzero().flatten().tolist() == on_boundary
    assert token.signal_b_T[0].sum() > full.signal_b_T[0].sum()  # the sampled token is read everywhere
    with torch.no_grad():
        logp_T_V = full.head(full.features_b_T_F[0]).float()
    assert logp_T_V.logsumexp(-1).tolist() == pytest.approx([0.0] * logp_T_V.shape[0], abs=1e-4)  # distributions
    # At the EOS position: the teacher's own end-of-turn probability on the student's EOS, its shared tokens mapped.
    t = P - 1 + len(recipes)
    ids = teacher_tok(teacher_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)["input_ids"] + teacher_tok(RESPONSES[0], add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        own = F.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
    end_id = teacher_tok.convert_tokens_to_ids("<end_of_turn>")
    assert float(logp_T_V[t, student.eos_token_id]) == pytest.approx(float(own[end_id]), abs=1e-4)
    def text_mass(dist, piece: str) -> float:  # the piece and its byte-fallback twin: one text, two teacher ids
        byte = teacher_tok.convert_tokens_to_ids(f"<0x{ord(piece):02X}>")
        return float(torch.logaddexp(dist[teacher_tok.convert_tokens_to_ids(piece)], dist[byte]))

    one = student.convert_tokens_to_ids("1")
    assert float(logp_T_V[t, one]) == pytest.approx(text_mass(own, "1"), abs=1e-4)
    # Before the student's '2' (inside the student's numeral, on the teacher's boundary after 'The answer is 4'):
    # the teacher's distribution after its first token, the student's '2' read as the teacher's '2'.
    with torch.no_grad():
        after_first = F.log_softmax(model(torch.tensor([ids[:len(ids) - 1]])).logits[0, -1].float(), -1)
    two = student.convert_tokens_to_ids("2")
    assert float(logp_T_V[P - 1 + 5, two]) == pytest.approx(text_mass(after_first, "2"), abs=1e-4)
    unshared = (aligned.student_map < 0).nonzero().flatten()
    table = token_bytes(teacher_tok)
    mapped = aligned.student_map[aligned.student_map >= 0].tolist()
    texts = {table[i] for i in mapped} - {None}
    covered = [v for v, b in enumerate(table) if b in texts] + [i for i in mapped if table[i] is None]
    rest = 1 - float(own[covered].exp().sum())
    assert float(logp_T_V[t, unshared].exp().sum()) == pytest.approx(rest, abs=1e-4)


def test_the_teacher_counts_its_own_tokens(toks, scored):
    _, teacher_tok = toks
    *_, token, full = scored
    prompt = len(teacher_tok(teacher_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
                             add_special_tokens=False)["input_ids"])
    resp = [len(teacher_tok(r, add_special_tokens=False)["input_ids"]) for r in ("The answer is 42.", "  12345 naïve", "h")]
    assert token.tokens == full.tokens == 3 * prompt + sum(resp) + 2  # two rows ended: the teacher's end of turn


def test_masked_positions_carry_no_gradient_into_the_update(toks, scored):
    """The update masks what the teacher could not read: changing the teacher's features there changes nothing."""
    from tasks.objectives.losses import Objective, chunked_objective

    student, _ = toks
    *_, rollout, responses, token, full = scored
    torch.manual_seed(0)
    H = 16
    head = torch.nn.Linear(H, len(student), bias=False)
    hidden = torch.randn(3, rollout.sequences_B_T.shape[1] - 1, H)
    mask = rollout.loss_mask_B_T() * full.signal_b_T[:, :-1]
    obj = Objective()
    base = chunked_objective(hidden, full.features_b_T_F[:, :-1], head, full.head, mask, obj, vocab_size=len(student))
    noisy = full.features_b_T_F.clone()
    noisy[..., :-3][full.signal_b_T == 0] = 5.0
    again = chunked_objective(hidden, noisy[:, :-1], head, full.head, mask, obj, vocab_size=len(student))
    assert again.loss.item() == base.loss.item() and base.loss.item() > 0


def test_its_own_samples_come_back_in_the_students_tokens(toks, scored):
    from tasks.specs.render import RowText

    student, _ = toks
    aligned = scored[0]
    prompt = student.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ro = aligned.sample(student, [RowText.of("r", prompt, MESSAGES)] * 2, [5, 5], 1.0, torch.Generator().manual_seed(0))
    assert ro.sequences_B_T.shape[0] == 2 and int(ro.response_lengths_B.max()) <= 5
    assert student.decode(ro.sequences_B_T[0, :ro.prompt_width], skip_special_tokens=False).endswith(prompt)
    texts, lengths, truncated = aligned.answer([RowText.of("r", prompt, MESSAGES)], 4)
    assert len(texts) == 1 and lengths[0] <= 4


# ------------------------------------------------------------------------------------------------- registration


@pytest.fixture(scope="module")
def other_teacher(tmp_path_factory, toks):
    _, teacher_tok = toks
    folder = tmp_path_factory.mktemp("other-teacher")
    tiny_llama(teacher_tok, 2, 512).eval().save_pretrained(folder)
    teacher_tok.save_pretrained(folder)
    return folder


def test_a_teacher_of_another_tokenizer_is_refused_as_plain_with_the_hint_and_registers_aligned(
        tmp_path, toks, other_teacher):
    from teachers.registry import IncompatibleTeacher, TeacherRegistry

    student, _ = toks
    reg = TeacherRegistry(tmp_path / "registry.json")
    with pytest.raises(IncompatibleTeacher, match="--wrapper aligned"):
        reg.register_checkpoint("other", "r", other_teacher, student, messages=MESSAGES)
    assert reg.list() == []
    rec = reg.register_checkpoint("other", "r", other_teacher, student, wrapper="aligned", messages=MESSAGES)
    assert (rec.wrapper, rec.transport) == ("aligned", "auto")
    assert reg.get("other").wrapper == "aligned"  # stored: the run's teachers come back from the registry alone


def test_an_aligned_teacher_without_a_chat_template_is_refused_on_a_chat_route(tmp_path, toks, other_teacher):
    import shutil

    from teachers.registry import IncompatibleTeacher, TeacherRegistry

    student, _ = toks
    bare = tmp_path / "bare"
    shutil.copytree(other_teacher, bare)
    (bare / "chat_template.jinja").unlink()
    reg = TeacherRegistry(tmp_path / "registry.json")
    with pytest.raises(IncompatibleTeacher, match="no chat template"):
        reg.register_checkpoint("bare", "r", bare, student, wrapper="aligned", messages=MESSAGES)
    reg.register_checkpoint("bare", "r", bare, student, wrapper="aligned")  # a format route: no template needed


def test_a_plain_teacher_without_a_chat_template_is_refused_on_a_chat_route(tmp_path, toks):
    from teachers.registry import IncompatibleTeacher, TeacherRegistry

    student, _ = toks
    folder = tmp_path / "same"
    tiny_llama(student, 3, 512).eval().save_pretrained(folder)
    student.save_pretrained(folder)
    (folder / "chat_template.jinja").unlink()
    reg = TeacherRegistry(tmp_path / "registry.json")
    with pytest.raises(IncompatibleTeacher, match="no chat template"):
        reg.register_checkpoint("same", "r", folder, student, messages=MESSAGES)


def test_an_aligned_record_needs_its_checkpoint():
    from pydantic import ValidationError

    from teachers.registry import TeacherRecord

    with pytest.raises(ValidationError, match="transport 'endpoint' is not supported"):
        TeacherRecord(name="x", route="r", model_uri="/m", tokenizer_fingerprint="sha256:0", wrapper="aligned",
                      transport="endpoint")


def test_a_teacher_whose_template_changed_since_registration_is_refused_at_load(tmp_path, toks, other_teacher):
    """Registration checked each template; the merge checks again when it loads the teacher, before its weights."""
    import shutil

    from tasks.merging.merge import load_teacher
    from teachers.registry import TeacherRegistry

    student, _ = toks
    reg = TeacherRegistry(tmp_path / "registry.json")
    folder = tmp_path / "same"
    tiny_llama(student, 3, 512).eval().save_pretrained(folder)
    student.save_pretrained(folder)
    plain = reg.register_checkpoint("same", "r", folder, student, messages=MESSAGES)
    assert load_teacher(plain, student, messages=MESSAGES) is not None
    template = folder / "chat_template.jinja"
    template.write_text(template.read_text().replace("<|im_start|>", "<|im_start|> "))  # edited after registering
    with pytest.raises(ValueError, match="chat templates render"):
        load_teacher(plain, student, messages=MESSAGES)
    load_teacher(plain, student)  # a format route reads no template

    other = shutil.copytree(other_teacher, tmp_path / "other")
    aligned = reg.register_checkpoint("other", "r", other, student, wrapper="aligned", messages=MESSAGES)
    assert load_teacher(aligned, student, messages=MESSAGES) is not None
    (other / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="no chat template"):
        load_teacher(aligned, student, messages=MESSAGES)
