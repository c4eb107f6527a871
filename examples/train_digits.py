"""Data-parallel training of an Equinox MLP on scikit-learn's digits, with every eqx_train part.

    python examples/train_digits.py --workdir workdir                   # jax.jit over a Mesh
    python examples/train_digits.py --workdir workdir --parallel pmap   # flax's pmap style

Runs on every local device (8 simulated CPU devices when there is no accelerator), checkpoints
every epoch, and resumes from the latest checkpoint when started again with the same
--workdir (in either mode: both save the same unsharded state). Ends with one line:
`test accuracy: 0.9xx`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

# Before JAX is imported: on a CPU-only machine, simulate 8 devices. The flag only affects
# the host platform, so on a GPU machine JAX still uses the GPUs it finds.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import eqx_train  # noqa: E402
from eqx_train import checkpoints  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Train an MLP on scikit-learn's digits (8x8 images, 10 classes), "
        "data-parallel over all local devices, with resumable checkpoints.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--workdir",
        default="workdir",
        help="where checkpoints and curves.png go; rerun with the same "
        "workdir to resume from its latest checkpoint",
    )
    parser.add_argument(
        "--parallel",
        choices=("mesh", "pmap"),
        default="mesh",
        help="mesh: one jax.jit step over a Mesh of all devices, the batch sharded along it "
        "and the state replicated; pmap: jax.pmap with a leading device axis (flax's style)",
    )
    parser.add_argument("--epochs", type=int, default=30, help="maximum number of epochs")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=128,
        help="global batch size, split evenly over the devices",
    )
    parser.add_argument(
        "--learning-rate",
        type=float,
        default=3e-3,
        help="peak learning rate of the warm-up + cosine schedule",
    )
    parser.add_argument(
        "--warmup-epochs", type=float, default=2.0, help="epochs of linear learning-rate warm-up"
    )
    parser.add_argument("--hidden", type=int, default=128, help="width of the hidden layers")
    parser.add_argument("--dropout", type=float, default=0.1, help="dropout rate")
    parser.add_argument(
        "--patience",
        type=int,
        default=5,
        help="early stopping: epochs without validation-loss improvement",
    )
    parser.add_argument(
        "--min-delta",
        type=float,
        default=1e-4,
        help="early stopping: smallest validation-loss decrease that counts",
    )
    parser.add_argument(
        "--eval-batch-size",
        type=int,
        default=100,
        help="rows per evaluation call (the last, smaller one is padded)",
    )
    parser.add_argument("--keep", type=int, default=2, help="newest checkpoints to keep")
    parser.add_argument(
        "--keep-every",
        type=int,
        default=10,
        help="also keep every checkpoint this many epochs apart",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for data order and model")
    parser.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="stop after this many epochs in this run, as if preempted (then rerun to resume)",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


class DigitsMLP(eqx.Module):
    layers: tuple[eqx.nn.Linear, ...]
    dropout: eqx.nn.Dropout

    def __init__(self, hidden: int, dropout: float, *, key: jax.Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.layers = (
            eqx.nn.Linear(64, hidden, key=k1),
            eqx.nn.Linear(hidden, hidden, key=k2),
            eqx.nn.Linear(hidden, 10, key=k3),
        )
        self.dropout = eqx.nn.Dropout(dropout)

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        inference = key is None
        keys = [None, None] if key is None else list(jax.random.split(key, 2))
        for layer, layer_key in zip(self.layers[:-1], keys, strict=True):
            x = self.dropout(jax.nn.relu(layer(x)), key=layer_key, inference=inference)
        return self.layers[-1](x)


def load_data(seed: int):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=seed, stratify=y
    )
    x_train, x_val, y_train, y_val = train_test_split(
        x_train, y_train, test_size=0.15, random_state=seed, stratify=y_train
    )
    return (x_train, y_train), (x_val, y_val), (x_test, y_test)


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    from tqdm import tqdm

    devices = jax.local_devices()
    n_devices = len(devices)
    if args.batch_size % n_devices:
        sys.exit(f"--batch-size {args.batch_size} must be divisible by {n_devices} devices")
    print(f"parallel: {args.parallel} over {n_devices} {devices[0].platform} devices", flush=True)
    (x_train, y_train), (x_val, y_val), (x_test, y_test) = load_data(args.seed)
    steps_per_epoch = len(x_train) // args.batch_size

    # -- state: TrainState (model + optimiser) and EarlyStopping, both pytrees.
    schedule = eqx_train.create_cosine_learning_rate_schedule(
        args.learning_rate,
        steps_per_epoch,
        halfcos_epochs=args.epochs,
        warmup_length=args.warmup_epochs,
    )
    model = DigitsMLP(args.hidden, args.dropout, key=jax.random.key(args.seed))
    state = eqx_train.TrainState.create(model=model, tx=optax.adamw(schedule, weight_decay=1e-4))
    stopper = eqx_train.EarlyStopping(min_delta=args.min_delta, patience=args.patience)
    history = {
        name: np.full(args.epochs, np.nan, np.float32)
        for name in ("train_loss", "train_accuracy", "val_loss", "val_accuracy")
    }
    bundle = {"state": state, "stopper": stopper, "epoch": -1, "history": history}

    # -- resume: the latest checkpoint, restored into the structure of the fresh bundle.
    ckpt_dir = os.path.join(args.workdir, "checkpoints")
    bundle = checkpoints.restore_checkpoint(ckpt_dir, bundle)
    start_epoch = bundle["epoch"] + 1
    if start_epoch > 0:
        print(f"resuming from {checkpoints.latest_checkpoint(ckpt_dir)} at epoch {start_epoch}")
    state, stopper, history = bundle["state"], bundle["stopper"], bundle["history"]

    # -- the parallel track: how the state, the batches and the steps meet the devices.
    arrays, static = eqx.partition(state, eqx.is_array)
    eval_rows = -(-args.eval_batch_size // n_devices)  # rows per device in every eval call
    make_track = mesh_track if args.parallel == "mesh" else pmap_track
    track = make_track(static, devices, eval_rows)

    def evaluate(on_device, x, y):
        logits = np.concatenate(
            [
                track.predict(on_device, x[i : i + args.eval_batch_size])
                for i in range(0, len(x), args.eval_batch_size)
            ]
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return float(loss), float(np.mean(logits.argmax(-1) == y))

    on_device = track.place(arrays)
    manager = checkpoints.AsyncManager()
    base_key = jax.random.key(args.seed + 1)
    epochs_this_run = 0
    for epoch in range(start_epoch, args.epochs):
        if bool(stopper.should_stop):
            break
        order = np.random.default_rng([args.seed, epoch]).permutation(len(x_train))
        batches = (
            {"x": x_train[idx], "y": y_train[idx]}
            for idx in np.split(order[: steps_per_epoch * args.batch_size], steps_per_epoch)
        )
        step_metrics = []
        with tqdm(
            total=steps_per_epoch,
            desc=f"epoch {epoch:2d}",
            leave=False,
            disable=args.no_progress,
            file=sys.stderr,
        ) as bar:
            for i, batch in enumerate(track.feed(batches)):
                step_key = jax.random.fold_in(base_key, epoch * steps_per_epoch + i)
                on_device, metrics = track.step(on_device, batch, step_key)
                step_metrics.append(metrics)
                bar.update(1)
                if i % 4 == 3 or i == steps_per_epoch - 1:
                    last = track.one_copy(metrics)
                    bar.set_postfix(
                        loss=f"{float(last['loss']):.3f}", acc=f"{float(last['accuracy']):.3f}"
                    )
        train = {k: float(v.mean()) for k, v in track.stack_metrics(step_metrics).items()}
        val_loss, val_accuracy = evaluate(on_device, x_val, y_val)
        stopper = stopper.update(val_loss)
        for name, value in (
            ("train_loss", train["loss"]),
            ("train_accuracy", train["accuracy"]),
            ("val_loss", val_loss),
            ("val_accuracy", val_accuracy),
        ):
            history[name][epoch] = value
        print(
            f"epoch {epoch:2d}: train loss {train['loss']:.4f} acc {train['accuracy']:.3f} | "
            f"val loss {val_loss:.4f} acc {val_accuracy:.3f}",
            flush=True,
        )

        state = eqx.combine(track.one_copy(on_device), static)
        bundle = {"state": state, "stopper": stopper, "epoch": epoch, "history": history}
        checkpoints.save_checkpoint(
            ckpt_dir,
            bundle,
            step=epoch,
            keep=args.keep,
            keep_every_n_steps=args.keep_every,
            async_manager=manager,
        )
        epochs_this_run += 1
        if args.stop_after is not None and epochs_this_run >= args.stop_after:
            manager.wait_previous_save()
            print(f"stopping after {epochs_this_run} epoch(s) as asked; rerun to resume")
            return float("nan")
    manager.wait_previous_save()
    if bool(stopper.should_stop):
        print(f"early stopping: no val-loss improvement for {args.patience + 1} epochs")

    plot_curves(history, os.path.join(args.workdir, "curves.png"))
    _, test_accuracy = evaluate(on_device, x_test, y_test)
    print(f"test accuracy: {test_accuracy:.3f}")
    return test_accuracy


def loss_and_metrics(model, x, y, key):
    """Mean cross-entropy over a batch, with one dropout key per example, and its metrics."""
    logits = jax.vmap(lambda xi, ki: model(xi, key=ki))(x, jax.random.split(key, len(x)))
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == y)}


class Track(NamedTuple):
    """How one parallel style places the state, feeds batches, steps and evaluates."""

    place: Callable[[Any], Any]  # host state arrays -> state on the devices
    feed: Callable[[Iterable[dict]], Iterator[dict]]  # host batches -> batches on the devices
    step: Callable[[Any, dict, jax.Array], tuple[Any, dict]]  # (state, batch, key) -> ...
    one_copy: Callable[[Any], Any]  # state or metrics on the devices -> one copy
    stack_metrics: Callable[[list], dict]  # per-step metrics -> host arrays over steps
    predict: Callable[[Any, np.ndarray], np.ndarray]  # (state, any number of rows) -> logits


def mesh_track(static, devices, eval_rows: int) -> Track:
    """jax.jit over a 1-D mesh: the state replicated, each batch split along the mesh."""
    mesh = Mesh(np.asarray(devices), ("batch",))
    replicated = NamedSharding(mesh, P())
    batch_sharding = NamedSharding(mesh, P("batch"))

    def train_step(state, x, y, key):
        grad_fn = eqx.filter_value_and_grad(loss_and_metrics, has_aux=True)
        (_, metrics), grads = grad_fn(state.model, x, y, key)  # XLA all-reduces the grads
        return state.apply_gradients(grads=grads), metrics

    step = eqx_train.jit_step(train_step, static, has_aux=True)  # donates the old state

    def predict(arrays, x):
        return jax.vmap(eqx.combine(arrays, static).model)(x)

    padded_predict = eqx_train.pad_shard_unpad(jax.jit(predict), mesh=mesh)
    return Track(
        place=lambda arrays: jax.device_put(arrays, replicated),
        feed=lambda batches: eqx_train.prefetch_to_device(
            (eqx_train.shard_to_mesh(b, mesh) for b in batches), size=2, devices=batch_sharding
        ),
        step=lambda arrays, batch, key: step(arrays, batch["x"], batch["y"], key),
        one_copy=lambda tree: tree,  # a replicated global array already is one copy
        stack_metrics=lambda steps: eqx_train.stack_forest(jax.device_get(steps)),
        predict=lambda arrays, x: padded_predict(arrays, x, min_device_batch=eval_rows),
    )


def pmap_track(static, devices, eval_rows: int) -> Track:
    """jax.pmap, as flax: a replica per device, each batch reshaped to (devices, rows, ...)."""
    n_devices = len(devices)

    def train_step(state, x, y, key):
        grad_fn = eqx.filter_value_and_grad(loss_and_metrics, has_aux=True)
        (_, metrics), grads = grad_fn(state.model, x, y, key)
        grads = eqx_train.pmean(grads, "batch")
        return state.apply_gradients(grads=grads), eqx_train.pmean(metrics, "batch")

    # The twin of jit_step: pmaps over the array part of the state, donating it.
    p_train_step = eqx_train.pmap_step(train_step, static, has_aux=True, devices=devices)

    def step(replicated, batch, key):
        keys = eqx_train.shard_prng_key(key, n_devices)  # one dropout key per device
        return p_train_step(replicated, batch["x"], batch["y"], keys)

    def predict(arrays, x):
        return jax.vmap(eqx.combine(arrays, static).model)(x)

    p_predict = eqx_train.pad_shard_unpad(jax.pmap(predict, devices=devices))
    return Track(
        place=lambda arrays: eqx_train.replicate(arrays, devices),
        feed=lambda batches: eqx_train.prefetch_to_device(
            map(eqx_train.shard, batches), size=2, devices=devices
        ),
        step=step,
        one_copy=eqx_train.unreplicate,
        stack_metrics=eqx_train.get_metrics,
        predict=lambda arrays, x: p_predict(arrays, x, min_device_batch=eval_rows),
    )


def plot_curves(history: dict[str, np.ndarray], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = np.arange(len(history["train_loss"]))
    done = ~np.isnan(history["train_loss"])
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for split in ("train", "val"):
        ax_loss.plot(epochs[done], history[f"{split}_loss"][done], marker="o", label=split)
        ax_acc.plot(epochs[done], history[f"{split}_accuracy"][done], marker="o", label=split)
    ax_loss.set(title="loss", xlabel="epoch")
    ax_acc.set(title="accuracy", xlabel="epoch")
    for ax in (ax_loss, ax_acc):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
