import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import elastic_trainer as et


# jitted: run op by op, building and running these models took 4 s a test
build = eqx.filter_jit(et.Transformer)
forward = eqx.filter_jit(lambda model, tokens: model(tokens))


def test_transformer_is_causal():
    model = build(vocab_size=32, seq_len=8, d_model=16, num_heads=2, num_layers=2, key=jax.random.key(0))
    tokens = jnp.arange(8) % 32
    changed = tokens.at[5].set(31)
    logits, logits_changed = forward(model, tokens), forward(model, changed)
    assert logits.shape == (8, 32)
    np.testing.assert_allclose(logits[:5], logits_changed[:5], rtol=1e-6, atol=1e-6)
    assert not np.allclose(logits[5:], logits_changed[5:])


def test_untrained_loss_is_near_uniform():
    model = build(vocab_size=256, seq_len=16, d_model=32, num_heads=4, num_layers=1, key=jax.random.key(0))
    batch = jax.random.randint(jax.random.key(1), (4, 17), 0, 256)
    loss = eqx.filter_jit(et.next_token_loss)(model, batch, key=jax.random.key(2))
    assert float(loss) == pytest.approx(np.log(256), rel=0.1)


def test_heads_must_divide_width():
    with pytest.raises(et.ConfigError, match=r"model.num_heads \(3\) must divide model.d_model \(16\)"):
        et.Transformer(d_model=16, num_heads=3, key=jax.random.key(0))
