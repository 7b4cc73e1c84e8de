"""An accelerate script as its documentation writes one: Accelerator(), prepare, a step, gather."""

import torch
from accelerate import Accelerator

if __name__ == "__main__":
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    x = torch.randn(8, 4) + accelerator.process_index
    loss = model(x).pow(2).mean()
    accelerator.backward(loss)
    optimizer.step()
    ranks = accelerator.gather(torch.tensor([accelerator.process_index])).tolist()
    accelerator.print(f"num_processes={accelerator.num_processes} gathered={ranks}")
    accelerator.end_training()
