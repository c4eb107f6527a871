"""A 10-second tour of eqx_train: TrainState, a schedule, jit_step and EarlyStopping.

Fits a small Equinox MLP to y = sin(3x) on synthetic data and stops early when the
validation loss stops improving. Runs on CPU; prints one line per epoch.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import eqx_train


def main() -> None:
    key_data, key_model = jax.random.split(jax.random.key(0))
    x = jax.random.uniform(key_data, (1024, 1), minval=-1.0, maxval=1.0)
    y = jnp.sin(3.0 * x)
    x_train, y_train, x_val, y_val = x[:768], y[:768], x[768:], y[768:]

    steps_per_epoch = 12
    schedule = eqx_train.create_cosine_learning_rate_schedule(
        3e-2, steps_per_epoch, halfcos_epochs=40, warmup_length=1
    )
    model = eqx.nn.MLP(1, 1, 64, 2, activation=jax.nn.tanh, key=key_model)
    state = eqx_train.TrainState.create(model=model, tx=optax.adam(schedule))

    def loss_fn(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    def train_step(state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(state.model, x, y)
        return state.apply_gradients(grads=grads), loss

    arrays, static = eqx.partition(state, eqx.is_array)
    step = eqx_train.jit_step(train_step, static, has_aux=True)
    evaluate = eqx.filter_jit(loss_fn)
    stopper = eqx_train.EarlyStopping(min_delta=1e-5, patience=3)

    for epoch in range(40):
        for batch in range(steps_per_epoch):
            sl = slice(batch * 64, (batch + 1) * 64)
            arrays, train_loss = step(arrays, x_train[sl], y_train[sl])
        val_loss = evaluate(eqx.combine(arrays, static).model, x_val, y_val)
        stopper = stopper.update(val_loss)
        print(
            f"epoch {epoch:2d}  train loss {float(train_loss):.5f}  val loss {float(val_loss):.5f}"
        )
        if stopper.should_stop:
            print(f"early stopping at epoch {epoch}")
            break
    state = eqx.combine(arrays, static)
    print(f"final step {int(state.step)}, best val loss {float(stopper.best_metric):.5f}")


if __name__ == "__main__":
    main()
