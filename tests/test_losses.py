"""Each loss against an independent float64 NumPy reference, plus gradient checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import test_util

from recomp_jax.training import losses


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


# ----------------------------------------------------------------------------- contrastive


def _contrastive_ref(q, p, mask, temperature, cosine, in_batch, qids, pids):
  b, s, _ = p.shape
  if cosine:
    q = q / np.linalg.norm(q, axis=-1, keepdims=True)
    p = p / np.linalg.norm(p, axis=-1, keepdims=True)
  total = 0.0
  for i in range(b):
    cands = []  # (score, is_target)
    for j in range(b):
      if not in_batch and j != i:
        continue
      for k in range(s):
        if not mask[j, k]:
          continue
        target = (j == i and k == 0)
        if not target:
          if pids is not None and pids[j, k] == pids[i, 0]:
            continue
          if qids is not None and k == 0 and qids[j] == qids[i]:
            continue
        cands.append((q[i] @ p[j, k] / temperature, target))
    scores = np.array([c[0] for c in cands])
    t = [c[1] for c in cands].index(True)
    total += -(scores[t] - np.log(np.exp(scores - scores.max()).sum()) - scores.max())
  return total / b


@pytest.mark.parametrize('cosine,in_batch', [(False, True), (True, True), (False, False)])
def test_contrastive_matches_reference(cosine, in_batch):
  rng = np.random.default_rng(0)
  b, s, d = 5, 4, 8
  q = rng.normal(size=(b, d))
  p = rng.normal(size=(b, s, d))
  mask = np.ones((b, s), bool)
  mask[1, 3] = mask[3, 2:] = False  # fewer hard negatives for some rows
  qids = np.array([10, 11, 12, 10, 14])  # query 0 and 3 are the same question
  pids = np.arange(b * s).reshape(b, s)
  pids[2, 1] = pids[4, 0]  # row 2 has row 4's positive text as a hard negative
  pids[4, 2] = pids[4, 0]  # a duplicate of the positive inside its own row
  temperature = 0.5
  loss, metrics = losses.contrastive_loss(jnp.asarray(q, jnp.float32), jnp.asarray(p, jnp.float32),
                                          jnp.asarray(mask), temperature=temperature,
                                          similarity='cosine' if cosine else 'dot',
                                          in_batch_negatives=in_batch, query_ids=jnp.asarray(qids),
                                          passage_ids=jnp.asarray(pids))
  ref = _contrastive_ref(q, p, mask, temperature, cosine, in_batch, qids, pids)
  np.testing.assert_allclose(float(loss), ref, rtol=1e-5, atol=1e-5)
  assert 0.0 <= float(metrics['accuracy']) <= 1.0


def test_contrastive_duplicates_are_not_negatives():
  # Two copies of one query with the same positive: without ids the copy's positive is a
  # (false) negative and raises the loss; with ids it is masked out.
  q = jnp.ones((2, 4))
  p = jnp.concatenate([jnp.ones((2, 1, 4)), -jnp.ones((2, 1, 4))], axis=1)
  mask = jnp.ones((2, 2), bool)
  naive, _ = losses.contrastive_loss(q, p, mask)
  fixed, _ = losses.contrastive_loss(q, p, mask, query_ids=jnp.array([7, 7]))
  assert float(naive) > float(fixed) + 0.5
  np.testing.assert_allclose(float(fixed), np.log1p(2 * np.exp(-8.0)), rtol=1e-4, atol=1e-7)


# ----------------------------------------------------------------------------- seq2seq


def _seq2seq_ref(logits, targets, mask, eps, reduction):
  lp = _log_softmax(logits)
  nll = -np.take_along_axis(lp, targets[..., None], -1)[..., 0]
  per = (1 - eps) * nll - eps * lp.mean(-1)
  per = per * mask
  return per.sum() / (mask.sum() if reduction == 'token_mean' else logits.shape[0])


@pytest.mark.parametrize('eps,reduction', [(0.0, 'token_mean'), (0.1, 'token_mean'),
                                           (0.0, 'sequence_sum')])
def test_seq2seq_matches_reference(eps, reduction):
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(3, 6, 11)) * 3
  targets = rng.integers(0, 11, size=(3, 6))
  mask = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]], np.float64)
  # Row 2 is an "empty summary": just EOS, still a valid one-token example.
  loss, metrics = losses.seq2seq_loss(jnp.asarray(logits, jnp.float32), jnp.asarray(targets),
                                      jnp.asarray(mask), label_smoothing=eps, reduction=reduction)
  np.testing.assert_allclose(float(loss), _seq2seq_ref(logits, targets, mask, eps, reduction),
                             rtol=1e-5)
  assert float(metrics['num_tokens']) == 10.0
  # What the loss averages over, for the loop to weight microbatches and evaluation batches by.
  assert float(metrics[losses.LOSS_WEIGHT]) == (10.0 if reduction == 'token_mean' else 3.0)
  # Padding positions must not matter.
  logits2 = logits.copy()
  logits2[1, 4:] = 100.0
  loss2, _ = losses.seq2seq_loss(jnp.asarray(logits2, jnp.float32), jnp.asarray(targets),
                                 jnp.asarray(mask), label_smoothing=eps, reduction=reduction)
  np.testing.assert_allclose(float(loss2), float(loss), rtol=1e-6)


# ----------------------------------------------------------------------------- knowledge injection


def test_knowledge_injection_matches_reference():
  rng = np.random.default_rng(2)
  b, t, v = 2, 9, 13
  logits = rng.normal(size=(b, t, v)) * 2
  tokens = rng.integers(0, v, size=(b, t))
  seg = np.array([[0, 0, 0, 1, 1, 1, 2, 2, 2], [0, 0, 1, 1, 2, 2, 2, 0, 0]])
  wk, ws = 0.5, 2.0
  loss, metrics = losses.knowledge_injection_loss(jnp.asarray(logits, jnp.float32),
                                                  jnp.asarray(tokens), jnp.asarray(seg),
                                                  knowledge_weight=wk, summary_weight=ws)
  lp = _log_softmax(logits)
  num, den, nk, ck = 0.0, 0, 0.0, 0
  for i in range(b):
    for j in range(1, t):
      if seg[i, j] == 0:
        continue
      nll = -lp[i, j - 1, tokens[i, j]]
      num += (wk if seg[i, j] == 1 else ws) * nll
      den += 1
      if seg[i, j] == 1:
        nk += nll
        ck += 1
  np.testing.assert_allclose(float(loss), num / den, rtol=1e-5)
  np.testing.assert_allclose(float(metrics['nll_knowledge']), nk / ck, rtol=1e-5)


# ----------------------------------------------------------------------------- ORPO


def _orpo_ref(lw, mw, ll, ml, lam, mode):
  out = []
  for i in range(lw.shape[0]):
    aw = (lw[i] * mw[i]).sum() / mw[i].sum()
    al = (ll[i] * ml[i]).sum() / ml[i].sum()
    r = (aw - np.log(1 - np.exp(aw))) - (al - np.log(1 - np.exp(al)))
    gap = ml[i].sum() - mw[i].sum()
    if mode == 'paper':
      lor = np.log1p(np.exp(-r)) * max(gap, 0.0)
    elif mode == 'released_code':
      lor = np.log1p(np.exp(-r * max(0.1 * gap, 1.0)))
    else:
      lor = np.log1p(np.exp(-r))
    out.append(-aw + lam * lor)
  return np.mean(out)


@pytest.mark.parametrize('mode', ['paper', 'released_code', 'none'])
def test_orpo_matches_reference(mode):
  rng = np.random.default_rng(3)
  lw = -rng.uniform(0.01, 3.0, size=(3, 5))
  ll = -rng.uniform(0.01, 3.0, size=(3, 30))
  mw = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], np.float64)
  ml = np.zeros((3, 30))
  ml[0, :30] = 1
  ml[1, :8] = 1
  ml[2, :4] = 1
  loss, _ = losses.orpo_loss(jnp.asarray(lw, jnp.float32), jnp.asarray(mw), jnp.asarray(ll, jnp.float32),
                             jnp.asarray(ml), orpo_lambda=0.3, length_mode=mode)
  np.testing.assert_allclose(float(loss), _orpo_ref(lw, mw, ll, ml, 0.3, mode), rtol=1e-5)


def test_orpo_paper_length_factor_never_flips_the_preference():
  """A rejected response shorter than the chosen one (a short failed candidate) would make the
  paper's (|y_l| - |y_w|) negative; the factor is clamped at 0, so that pair trains SFT only."""
  lw = jnp.asarray([[-0.5, -0.7, -0.2, -0.1]])
  ll = jnp.asarray([[-0.3, -0.2, 0.0, 0.0]])
  mw, ml = jnp.ones((1, 4)), jnp.asarray([[1.0, 1.0, 0.0, 0.0]])
  loss, metrics = losses.orpo_loss(lw, mw, ll, ml, orpo_lambda=2.5, length_mode='paper')
  np.testing.assert_allclose(float(loss), float(metrics['sft']), rtol=1e-6)
  grads = jax.grad(lambda b: losses.orpo_loss(lw, mw, b, ml, orpo_lambda=2.5)[0])(ll)
  assert float(jnp.abs(grads).sum()) == 0.0  # no push on the rejected response either way
  longer = jnp.concatenate([ll, jnp.full((1, 4), -0.4)], axis=1)
  loss_longer, _ = losses.orpo_loss(lw, mw, longer, jnp.ones((1, 8)), orpo_lambda=2.5)
  assert float(loss_longer) > float(metrics['sft'])


def test_orpo_odds_ratio_term_equals_trl():
  """TRL's ORPOTrainer.odds_ratio_loss on the same average log-probabilities gives our L_OR
  (length_mode='none'); its SFT term (one token mean over the batch) equals ours when the chosen
  responses have equal lengths."""
  import types  # pylint: disable=import-outside-toplevel

  import torch  # pylint: disable=import-outside-toplevel  (the test extra's; a missing one is a failure, not a skip)
  from trl.experimental.orpo import orpo_trainer  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(11)
  lw = -rng.uniform(0.01, 2.0, size=(4, 6)).astype(np.float32)
  ll = -rng.uniform(0.01, 2.0, size=(4, 9)).astype(np.float32)
  mw = np.ones((4, 6), np.float32)
  ml = np.ones((4, 9), np.float32)
  ml[1, 5:] = 0
  lam = 2.5
  loss, metrics = losses.orpo_loss(jnp.asarray(lw), jnp.asarray(mw), jnp.asarray(ll), jnp.asarray(ml),
                                   orpo_lambda=lam, length_mode='none')
  fake = types.SimpleNamespace(beta=lam, accelerator=types.SimpleNamespace(device='cpu'))
  avg_w = torch.tensor((lw * mw).sum(-1) / mw.sum(-1))
  avg_l = torch.tensor((ll * ml).sum(-1) / ml.sum(-1))
  trl_losses, *_ , trl_log_odds = orpo_trainer.ORPOTrainer.odds_ratio_loss(fake, avg_w, avg_l)
  trl_nll = -float((torch.tensor(lw) * torch.tensor(mw)).sum() / torch.tensor(mw).sum())
  trl_loss = trl_nll - float(trl_losses.mean())
  np.testing.assert_allclose(float(loss), trl_loss, rtol=1e-5)
  np.testing.assert_allclose(float(metrics['log_odds_ratio']), float(trl_log_odds), rtol=1e-4, atol=1e-6)

def test_orpo_is_stable_near_probability_one():
  # Token log-probs of ~-1e-9 (P ~ 1) must not give inf/nan.
  lw = jnp.full((2, 4), -1e-9)
  ll = jnp.full((2, 4), -5.0)
  m = jnp.ones((2, 4))
  loss, metrics = losses.orpo_loss(lw, m, ll, m)
  grads = jax.grad(lambda x: losses.orpo_loss(x, m, ll, m)[0])(lw)
  assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(grads)))
  assert float(metrics['preference_accuracy']) == 1.0


# ----------------------------------------------------------------------------- gradients


def test_gradients_match_finite_differences():
  with jax.enable_x64(True):
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.normal(size=(3, 4)))
    p = jnp.asarray(rng.normal(size=(3, 2, 4)))
    mask = jnp.ones((3, 2), bool)
    test_util.check_grads(lambda a, b: losses.contrastive_loss(a, b, mask, temperature=0.7,
                                                               similarity='cosine')[0],
                          (q, p), order=1, modes=['rev'], atol=1e-5, rtol=1e-5)
    logits = jnp.asarray(rng.normal(size=(2, 3, 5)))
    targets = jnp.asarray(rng.integers(0, 5, size=(2, 3)))
    tmask = jnp.asarray([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    test_util.check_grads(lambda x: losses.seq2seq_loss(x, targets, tmask, label_smoothing=0.1)[0],
                          (logits,), order=1, modes=['rev'], atol=1e-5, rtol=1e-5)
    seg = jnp.asarray([[0, 1, 2], [0, 2, 2]])
    test_util.check_grads(lambda x: losses.knowledge_injection_loss(x, targets, seg)[0],
                          (logits,), order=1, modes=['rev'], atol=1e-5, rtol=1e-5)
    lw = jnp.asarray(-rng.uniform(0.1, 2.0, size=(2, 3)))
    ll = jnp.asarray(-rng.uniform(0.1, 2.0, size=(2, 5)))
    for mode in ('paper', 'released_code'):
      test_util.check_grads(lambda a, b: losses.orpo_loss(a, jnp.ones((2, 3)), b, jnp.ones((2, 5)),
                                                          length_mode=mode)[0],
                            (lw, ll), order=1, modes=['rev'], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- listwise distillation


def test_listwise_distillation_matches_reference():
  rng = np.random.default_rng(7)
  scores = rng.normal(size=(4, 6))
  teacher = rng.normal(size=(4, 6)) * 3
  valid = np.ones((4, 6), bool)
  valid[1, 4:] = False
  valid[3, 1:] = False  # a single candidate: KL 0
  expected = []
  for b in range(4):
    v = valid[b]
    log_q = _log_softmax(scores[b][v] / 0.5)
    log_p = _log_softmax(teacher[b][v] / 2.0)
    expected.append(np.sum(np.exp(log_p) * (log_p - log_q)))
  with jax.enable_x64():
    loss, metrics = losses.listwise_distillation_loss(jnp.asarray(scores), jnp.asarray(teacher),
                                                      jnp.asarray(valid), temperature=0.5,
                                                      teacher_temperature=2.0)
  assert float(loss) == pytest.approx(np.mean(expected), rel=1e-10)
  agree = np.mean([np.argmax(np.where(valid[b], scores[b], -np.inf)) == np.argmax(np.where(valid[b], teacher[b], -np.inf))
                   for b in range(4)])
  assert float(metrics['top1_agreement']) == pytest.approx(agree)
  # Equal distributions: zero loss; padding slots never matter.
  same, _ = losses.listwise_distillation_loss(jnp.asarray(teacher), jnp.asarray(teacher * 999 * ~valid + teacher * valid),
                                              jnp.asarray(valid))
  assert abs(float(same)) < 1e-5
