"""The reference task's data: the bundled digits read without scikit-learn, and their held-out split."""

import subprocess
import sys

import numpy as np

from fedge.app.digits import TEST_FRACTION, digits_split, load_digits_arrays, stratified_split


def test_bundled_digits_equal_scikit_learns_loader():
    from sklearn.datasets import load_digits

    images, labels = load_digits_arrays()
    reference = load_digits()
    assert images.shape == (1797, 1, 8, 8) and images.dtype == np.float32
    np.testing.assert_allclose(images[:, 0], reference.images / 16.0, rtol=1e-6)
    np.testing.assert_array_equal(labels, reference.target)


def test_loading_the_task_data_does_not_import_scikit_learn():
    code = (
        "import sys; from fedge.app.task import DigitsTask; DigitsTask().test_set(1, alpha=0.5, seed=0); "
        "print('sklearn' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_stratified_split_keeps_class_shares_and_is_fixed():
    labels = np.repeat(np.arange(5), [10, 20, 30, 40, 50])
    train, test = stratified_split(labels, 0.2, seed=3)
    assert not set(train) & set(test) and len(train) + len(test) == len(labels)
    np.testing.assert_array_equal(np.bincount(labels[test]), [2, 4, 6, 8, 10])
    again = stratified_split(labels, 0.2, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip((train, test), again, strict=True))
    assert not np.array_equal(stratified_split(labels, 0.2, seed=4)[1], test)


def test_digits_test_split_holds_a_fifth_of_every_class():
    _, train_labels = digits_split("train")
    _, test_labels = digits_split("test")
    assert len(train_labels) + len(test_labels) == 1797
    test_counts, train_counts = np.bincount(test_labels.numpy()), np.bincount(train_labels.numpy())
    assert np.all(np.abs(test_counts / (test_counts + train_counts) - TEST_FRACTION) < 0.01)
