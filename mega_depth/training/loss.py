"""The training loss of one micro-batch, as every backend computes it (Megatron-core, DeepSpeed, XLA): the NaN policy
needs all of them to see the same value."""


def token_mean_loss(per_token, loss_mask, poison: bool = False, cp_group=None):
    """Mean token loss of one micro-batch, fp32. A non-finite loss (or an injected fault) is made NaN so that its
    gradients are NaN too: every backend then sees the same thing (an inf loss can have finite gradients).
    Under context parallelism (`cp_group`) this rank's tokens are part of each sequence: the sum of its tokens'
    losses over the whole micro-batch's token count, so that the CP ranks' values add up to the mean."""
    import torch

    mask = loss_mask.float()
    count = mask.sum()
    if cp_group is not None:
        torch.distributed.all_reduce(count, group=cp_group)
    loss = (per_token.float() * mask).sum() / count.clamp(min=1)
    ok = torch.isfinite(loss.detach()) & (not poison)
    return loss * torch.where(ok, 1.0, float("nan"))  # a constant factor: 1, or NaN for the loss and its grads
