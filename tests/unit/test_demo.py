import torch

from eagle3_datagen.targets.demo import fit_to_conversations
from tests.helpers import tiny_qwen3


def fitted(seed):
    torch.manual_seed(seed)
    model = tiny_qwen3(300, num_layers=4, tie_word_embeddings=True)
    sequences = [[1, 5, 9, 17, 5, 9, 2], [3, 5, 9, 2], [7, 7, 11, 13, 17, 19, 23, 2]]
    losses = fit_to_conversations(model, sequences, steps=6, learning_rate=0.02, seed=seed)
    return losses, model.get_input_embeddings().weight.detach().clone()


def test_fitting_is_reproducible_and_learns():
    losses_a, table_a = fitted(0)
    losses_b, table_b = fitted(0)
    assert losses_a == losses_b
    assert torch.equal(table_a, table_b)
    assert losses_a[-1] < losses_a[0]
    assert not torch.are_deterministic_algorithms_enabled()  # the global setting is restored


def test_untied_fitting_trains_both_tables_on_the_masked_positions():
    torch.manual_seed(0)
    model = tiny_qwen3(300, num_layers=4, tie_word_embeddings=False)
    embed = model.get_input_embeddings().weight.detach().clone()
    head = model.get_output_embeddings().weight.detach().clone()
    sequences = [[1, 5, 9, 17, 5, 9, 2], [3, 5, 9, 2]]
    masks = [[0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1]]
    losses = fit_to_conversations(model, sequences, steps=6, learning_rate=0.02, seed=0, loss_masks=masks)
    assert losses[-1] < losses[0]
    used = sorted({t for s in sequences for t in s})
    unused = [t for t in range(300) if t not in used]
    for before, after in ((embed, model.get_input_embeddings().weight), (head, model.get_output_embeddings().weight)):
        assert not torch.equal(before[used], after[used]) and torch.equal(before[unused], after[unused])

    def first_loss(loss_masks):
        torch.manual_seed(0)
        fresh = tiny_qwen3(300, num_layers=4, tie_word_embeddings=False)
        return fit_to_conversations(fresh, sequences, steps=1, learning_rate=0.02, seed=0, loss_masks=loss_masks)

    everything = [[1] * len(s) for s in sequences]
    assert first_loss(everything) == first_loss(None) != first_loss(masks) == losses[:1]
