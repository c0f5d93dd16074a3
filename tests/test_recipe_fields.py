"""Each field of each recipe (mars_plugin/networks/recipes.py) against the upstream line it cites.

:data:`QUOTED` quotes every cited upstream line (stripped) as a string; for each field,
``test_field_quotes_the_mirror`` checks that the quote is what stands at that path and line of
the upstream commit (where the local mirror of /work/.mirror exists: CI has none, and that half
is skipped), and ``test_field_is_the_plain_reading`` that the field equals a plain reading of
the quoted lines (:data:`READ`). Then the arithmetic around the recipes: epochs to iterations
against a real ``DataLoader`` / ``DistributedSampler``, the three poly schedules against their
upstream definitions written out as loops, the overrides' errors, and immutability.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import math
import re
import subprocess
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from mars_plugin.engines.crf_params import CRF_PRESETS
from mars_plugin.networks import deeplab
from mars_plugin.networks.recipes import (RECIPES, Recipe, get_recipe, iterations_for_epochs, poly_factor,
                                          recipe_from_dict, recipe_to_dict, with_overrides)
from mars_plugin.networks.recipe_checks import META_FIELDS

MIRRORS = Path("/work/.mirror")

#: (recipe, "path:line") -> the upstream line, stripped of its indentation.
QUOTED: Dict[Tuple[str, str], str] = {
    # dhr
    ('dhr', 'train.py:84'): 'model = networks.DeepLabv3plus_with_DHR(',
    ('dhr', 'train.py:366'): "'backbone': 'resnet101', 'decoder': 'deeplabv3+', 'wss': 'MARS', 'uss': 'CAUSE', 'tag': 'ResNet-101@', 'tau': 0.8,",
    ('dhr', 'core/networks.py:137'): 'def __init__(self, backbone, num_seg_classes=21, num_cls_classes=20, feature_size=256, low_channels=48, output_stride=8):',
    ('dhr', 'core/networks.py:74'): 'def __init__(self, backbone, num_classes=20+1, feature_size=256, low_channels=48, output_stride=8):',
    ('dhr', 'core/backbones/resnet/model.py:10'): "'resnet101': 'https://download.pytorch.org/models/resnet101-5d3b4d8f.pth',",
    ('dhr', 'tools/transforms.py:10'): 'IMAGENET_MEAN = [0.485, 0.456, 0.406]',
    ('dhr', 'tools/transforms.py:11'): 'IMAGENET_STD = [0.229, 0.224, 0.225]',
    ('dhr', 'tools/transforms.py:236'): 'def __init__(self, mean=IMAGENET_MEAN, std=IMAGENET_STD):',
    ('dhr', 'train.py:370'): "'train_transform': 'RandomResize,RandomHFlip,ColorJitter,Normalize,RandomCrop',",
    ('dhr', 'train.py:367'): "'image': 512, 'batch': 16, 'epochs': 100,",
    ('dhr', 'train.py:369'): "'min_image': 320, 'max_image': 640, 'b_factor': 0.3, 'c_factor': 0.3, 's_factor': 0.3, 'h_factor': 0.1,",
    ('dhr', 'tools/transforms.py:133'): 'def __init__(self, p=0.5):',
    ('dhr', 'train.py:200'): 'self.optimizer = optimizers.SGD(',
    ('dhr', 'train.py:368'): "'lr': 1e-3, 'wd': 4e-5, 'optimizer': 'SGD', 'momentum': 0.9, 'nesterov': False, 'scheduler': 'PolyLR', 'ema': 0.999,",
    ('dhr', 'train.py:202'): "{'params': self.param_groups[0], 'lr': args.lr, 'weight_decay': args.wd},",
    ('dhr', 'train.py:203'): "{'params': self.param_groups[1], 'lr': args.lr, 'weight_decay': args.wd},",
    ('dhr', 'train.py:204'): "{'params': self.param_groups[2], 'lr': 10*args.lr, 'weight_decay': args.wd},",
    ('dhr', 'train.py:205'): "{'params': self.param_groups[3], 'lr': 10*args.lr, 'weight_decay': args.wd},",
    ('dhr', 'core/layers.py:12'): "if norm_fn == 'bn': self.norm_fn = nn.BatchNorm2d",
    ('dhr', 'core/layers.py:36'): 'def __init__(self, inplanes, planes, kernel_size, padding=0, dilation=1, bias=False, dropout=0., norm=nn.BatchNorm2d, act=lambda: nn.ReLU(inplace=True)):',
    ('dhr', 'core/layers.py:24'): 'for name, value in self.named_parameters():',
    ('dhr', 'tools/trainers.py:125'): 'self.optimizer.zero_grad()',
    ('dhr', 'tools/trainers.py:126'): 'loss.backward()',
    ('dhr', 'tools/trainers.py:127'): 'self.optimizer.step()',
    ('dhr', 'train.py:211'): "'max_iterations': self.train_iterations * self.param.max_epochs",
    ('dhr', 'train.py:193'): 'self.train_loader = DataLoader(self.train_dataset, batch_size=args.batch // WORLD_SIZE, num_workers=args.cpus, shuffle=shuffle, drop_last=True, pin_memory=True, sampler=train_sampler, collate_fn=collate)',
    ('dhr', 'train.py:210'): "'power': 0.9,",
    ('dhr', 'tools/optimizers.py:16'): 'self.scheduler.step()',
    ('dhr', 'tools/schedulers.py:37'): 'lr_mult = (1 - self.iteration / self.max_iterations) ** self.power',
    ('dhr', 'train.py:325'): "loss_seg = seg_loss_fn(logits, torch_utils.resize(pseudo_masks.float(), logits.shape[2:], mode='nearest').long())",
    ('dhr', 'train.py:224'): 'output_dict = self.model(images, with_features=True)',
    ('dhr', 'tools/trainers.py:186'): 'if self.param.use_ema: model = self.ema.get()',
    ('dhr', 'train.py:166'): 'args.seed, True, args.ema,',
    ('dhr', 'core/networks.py:94'): "def apply_ms(self, image, scales=[1.0, 0.5, 1.5, 2.0], hflip=True, interpolation='bilinear', with_features=False):",
    ('dhr', 'produce_wss_masks.py:39'): 'output_dict = model.apply_ms(image)',
    ('dhr', 'core/networks.py:127'): "output_dict = {'pred_mask': torch_utils.resize(torch.mean(torch.stack(pred_masks), dim=0), image.shape[2:])}",
    ('dhr', 'core/refinements/densecrf.py:10'): 'def __init__(self, iter_max=10, pos_w=3, pos_xy_std=1, bi_w=4, bi_xy_std=67, bi_rgb_std=3, for_seg=False):',
    ('dhr', 'produce_wss_masks.py:115'): 'crf_fn = refinements.DenseCRF(for_seg=True)',
    ('dhr', 'produce_wss_masks.py:59'): 'image = denorm_fn(image).copy()',
    ('dhr', 'tools/transforms.py:270'): 'image = (image * 255).astype(np.uint8)',
    ('dhr', 'produce_wss_masks.py:136'): "'threshold': 0.05, # to reduce inference time related to CRF",
    # deeplab-pytorch
    ('deeplab-pytorch', 'configs/voc12.yaml:31'): 'NAME: DeepLabV2_ResNet101_MSC',
    ('deeplab-pytorch', 'configs/voc12.yaml:32'): 'N_BLOCKS: [3, 4, 23, 3]',
    ('deeplab-pytorch', 'libs/models/deeplabv2.py:41'): 'Output stride is fixed at 8',
    ('deeplab-pytorch', 'configs/voc12.yaml:34'): 'INIT_MODEL: data/models/coco/deeplabv1_resnet101/caffemodel/deeplabv1_resnet101-coco.pth',
    ('deeplab-pytorch', 'main.py:152'): 'model.base.load_state_dict(state_dict, strict=False)  # to skip ASPP',
    ('deeplab-pytorch', 'libs/datasets/voc.py:51'): 'image = cv2.imread(image_path, cv2.IMREAD_COLOR).astype(np.float32)',
    ('deeplab-pytorch', 'libs/datasets/base.py:110'): 'image -= self.mean_bgr',
    ('deeplab-pytorch', 'main.py:122'): 'augment=True,',
    ('deeplab-pytorch', 'configs/voc12.yaml:27'): 'TRAIN: 321',
    ('deeplab-pytorch', 'configs/voc12.yaml:11'): 'SCALES: [0.5, 0.75, 1.0, 1.25, 1.5]',
    ('deeplab-pytorch', 'libs/datasets/base.py:100'): 'if random.random() < 0.5:',
    ('deeplab-pytorch', 'configs/voc12.yaml:47'): 'OPTIMIZER: sgd',
    ('deeplab-pytorch', 'configs/voc12.yaml:45'): 'LR: 2.5e-4',
    ('deeplab-pytorch', 'configs/voc12.yaml:46'): 'MOMENTUM: 0.9',
    ('deeplab-pytorch', 'main.py:180'): 'momentum=CONFIG.SOLVER.MOMENTUM,',
    ('deeplab-pytorch', 'main.py:181'): ')',
    ('deeplab-pytorch', 'configs/voc12.yaml:49'): 'WEIGHT_DECAY: 5.0e-4',
    ('deeplab-pytorch', 'main.py:166'): '"lr": CONFIG.SOLVER.LR,',
    ('deeplab-pytorch', 'main.py:171'): '"lr": 10 * CONFIG.SOLVER.LR,',
    ('deeplab-pytorch', 'main.py:176'): '"lr": 20 * CONFIG.SOLVER.LR,',
    ('deeplab-pytorch', 'main.py:167'): '"weight_decay": CONFIG.SOLVER.WEIGHT_DECAY,',
    ('deeplab-pytorch', 'main.py:172'): '"weight_decay": CONFIG.SOLVER.WEIGHT_DECAY,',
    ('deeplab-pytorch', 'main.py:177'): '"weight_decay": 0.0,',
    ('deeplab-pytorch', 'main.py:208'): 'model.module.base.freeze_bn()',
    ('deeplab-pytorch', 'libs/models/resnet.py:43'): 'self.add_module("bn", _BATCH_NORM(out_ch, eps=1e-5, momentum=1 - 0.999))',
    ('deeplab-pytorch', 'main.py:53'): 'if isinstance(m[1], nn.Conv2d):',
    ('deeplab-pytorch', 'main.py:60'): 'if isinstance(m[1], nn.Conv2d):',
    ('deeplab-pytorch', 'main.py:66'): 'if isinstance(m[1], nn.Conv2d):',
    ('deeplab-pytorch', 'libs/models/deeplabv2.py:27'): 'nn.Conv2d(in_ch, out_ch, 3, 1, padding=rate, dilation=rate, bias=True),',
    ('deeplab-pytorch', 'configs/voc12.yaml:38'): 'TRAIN: 5',
    ('deeplab-pytorch', 'configs/voc12.yaml:41'): 'ITER_SIZE: 2',
    ('deeplab-pytorch', 'configs/voc12.yaml:40'): 'ITER_MAX: 20000',
    ('deeplab-pytorch', 'main.py:131'): 'loader = torch.utils.data.DataLoader(',
    ('deeplab-pytorch', 'main.py:132'): 'dataset=dataset,',
    ('deeplab-pytorch', 'main.py:133'): 'batch_size=CONFIG.SOLVER.BATCH_SIZE.TRAIN,',
    ('deeplab-pytorch', 'main.py:134'): 'num_workers=CONFIG.DATALOADER.NUM_WORKERS,',
    ('deeplab-pytorch', 'main.py:135'): 'shuffle=True,',
    ('deeplab-pytorch', 'main.py:136'): ')',
    ('deeplab-pytorch', 'configs/voc12.yaml:48'): 'POLY_POWER: 0.9',
    ('deeplab-pytorch', 'configs/voc12.yaml:44'): 'LR_DECAY: 10',
    ('deeplab-pytorch', 'libs/utils/lr_scheduler.py:20'): 'return lr * (1 - float(self.last_epoch) / self.iter_max) ** self.power',
    ('deeplab-pytorch', 'main.py:235'): 'labels_ = resize_labels(labels, size=(H, W))',
    ('deeplab-pytorch', 'libs/models/__init__.py:38'): 'scales=[0.5, 0.75],',
    ('deeplab-pytorch', 'main.py:335'): 'model.load_state_dict(state_dict)',
    ('deeplab-pytorch', 'main.py:282'): 'model.module.state_dict(), os.path.join(checkpoint_dir, "checkpoint_final.pth")',
    ('deeplab-pytorch', 'libs/models/msc.py:41'): 'logits_all = [logits] + [interp(l) for l in logits_pyramid]',
    ('deeplab-pytorch', 'main.py:372'): 'logits = model(images)',
    ('deeplab-pytorch', 'libs/models/msc.py:42'): 'logits_max = torch.max(torch.stack(logits_all), dim=0)[0]',
    ('deeplab-pytorch', 'libs/models/msc.py:47'): 'return logits_max',
    ('deeplab-pytorch', 'configs/voc12.yaml:53'): 'ITER_MAX: 10',
    ('deeplab-pytorch', 'configs/voc12.yaml:54'): 'POS_W: 3',
    ('deeplab-pytorch', 'configs/voc12.yaml:55'): 'POS_XY_STD: 1',
    ('deeplab-pytorch', 'configs/voc12.yaml:56'): 'BI_W: 4',
    ('deeplab-pytorch', 'configs/voc12.yaml:57'): 'BI_XY_STD: 67',
    ('deeplab-pytorch', 'configs/voc12.yaml:58'): 'BI_RGB_STD: 3',
    ('deeplab-pytorch', 'main.py:481'): 'image = image.astype(np.uint8).transpose(1, 2, 0)',
    ('deeplab-pytorch', 'main.py:385'): 'labels = torch.argmax(probs, dim=1)',
    # seam
    ('seam', 'experiment/seamv1-pseudovoc/config.py:29'): "'MODEL_NAME': 'deeplabv1',",
    ('seam', 'experiment/seamv1-pseudovoc/config.py:30'): "'MODEL_BACKBONE': 'resnet38',",
    ('seam', 'lib/net/backbone/resnet38d.py:130'): 'self.conv1a = nn.Conv2d(3, 64, 3, padding=1, bias=False)',
    ('seam', 'lib/net/backbone/resnet38d.py:132'): 'self.b2 = ResBlock(64, 128, 128, stride=2, norm_layer=self.norm_layer)',
    ('seam', 'lib/net/backbone/resnet38d.py:136'): 'self.b3 = ResBlock(128, 256, 256, stride=2, norm_layer=self.norm_layer)',
    ('seam', 'lib/net/backbone/resnet38d.py:140'): 'self.b4 = ResBlock(256, 512, 512, stride=2, norm_layer=self.norm_layer)',
    ('seam', 'lib/net/backbone/resnet38d.py:147'): 'self.b5 = ResBlock(512, 512, 1024, stride=1, first_dilation=1, dilation=2, norm_layer=self.norm_layer)',
    ('seam', 'lib/net/backbone/resnet38d.py:151'): 'self.b6 = ResBlock_bot(1024, 2048, stride=1, dilation=4, dropout=0.3, norm_layer=self.norm_layer)',
    ('seam', 'lib/net/backbone/resnet38d.py:153'): 'self.b7 = ResBlock_bot(2048, 4096, dilation=4, dropout=0.5, norm_layer=self.norm_layer)',
    ('seam', 'lib/net/backbone/resnet38d.py:7'): "model_url='/home1/wangyude/project/SEAM/models/ilsvrc-cls_rna-a1_cls1000_ep-0001.params'",
    ('seam', 'lib/net/backbone/resnet38d.py:270'): 'weight_dict = convert_mxnet_to_torch(model_url)',
    ('seam', 'experiment/seamv1-pseudovoc/config.py:19'): "'DATA_MEAN': [0.485, 0.456, 0.406],",
    ('seam', 'experiment/seamv1-pseudovoc/config.py:20'): "'DATA_STD': [0.229, 0.224, 0.225],",
    ('seam', 'lib/datasets/VOCDataset.py:65'): 'image_rgb = cv2.cvtColor(image, cv2.COLOR_BGR2RGB)',
    ('seam', 'experiment/seamv1-pseudovoc/train.py:40'): "transform = 'weak'",
    ('seam', 'lib/datasets/BaseDataset.py:79'): "if self.transform == 'weak':",
    ('seam', 'lib/datasets/BaseDataset.py:80'): 'sample = self.__weak_augment__(sample)',
    ('seam', 'experiment/seamv1-pseudovoc/config.py:21'): "'DATA_RANDOMCROP': 448,",
    ('seam', 'experiment/seamv1-pseudovoc/config.py:22'): "'DATA_RANDOMSCALE': [0.5, 1.5],",
    ('seam', 'experiment/seamv1-pseudovoc/config.py:23'): "'DATA_RANDOM_H': 10,",
    ('seam', 'experiment/seamv1-pseudovoc/config.py:24'): "'DATA_RANDOM_S': 10,",
    ('seam', 'experiment/seamv1-pseudovoc/config.py:25'): "'DATA_RANDOM_V': 10,",
    ('seam', 'experiment/seamv1-pseudovoc/config.py:26'): "'DATA_RANDOMFLIP': 0.5,",
    ('seam', 'experiment/seamv1-pseudovoc/train.py:71'): 'optimizer = optim.SGD(',
    ('seam', 'experiment/seamv1-pseudovoc/config.py:35'): "'TRAIN_LR': 0.001,",
    ('seam', 'experiment/seamv1-pseudovoc/config.py:36'): "'TRAIN_MOMENTUM': 0.9,",
    ('seam', 'experiment/seamv1-pseudovoc/train.py:78'): 'momentum=cfg.TRAIN_MOMENTUM,',
    ('seam', 'experiment/seamv1-pseudovoc/train.py:79'): 'weight_decay=cfg.TRAIN_WEIGHT_DECAY',
    ('seam', 'experiment/seamv1-pseudovoc/train.py:80'): ')',
    ('seam', 'experiment/seamv1-pseudovoc/config.py:37'): "'TRAIN_WEIGHT_DECAY': 0.0005,",
    ('seam', 'experiment/seamv1-pseudovoc/train.py:73'): "{'params': parameter_groups[0], 'lr': cfg.TRAIN_LR, 'weight_decay': cfg.TRAIN_WEIGHT_DECAY},",
    ('seam', 'experiment/seamv1-pseudovoc/train.py:74'): "{'params': parameter_groups[1], 'lr': 2*cfg.TRAIN_LR, 'weight_decay': 0},",
    ('seam', 'experiment/seamv1-pseudovoc/train.py:75'): "{'params': parameter_groups[2], 'lr': 10*cfg.TRAIN_LR, 'weight_decay': cfg.TRAIN_WEIGHT_DECAY},",
    ('seam', 'experiment/seamv1-pseudovoc/train.py:76'): "{'params': parameter_groups[3], 'lr': 20*cfg.TRAIN_LR, 'weight_decay': 0},",
    ('seam', 'experiment/seamv1-pseudovoc/config.py:33'): "'MODEL_FREEZEBN': False,",
    ('seam', 'lib/net/deeplabv1.py:22'): 'self.bn_fov = batchnorm(512, momentum=cfg.TRAIN_BN_MOM, affine=True)',
    ('seam', 'experiment/seamv1-pseudovoc/config.py:38'): "'TRAIN_BN_MOM': 0.0003,",
    ('seam', 'lib/net/backbone/resnet38d.py:8'): 'bn_mom = 0.0003',
    ('seam', 'experiment/seamv1-pseudovoc/config.py:40'): "'TRAIN_BATCHES': 10,",
    ('seam', 'experiment/seamv1-pseudovoc/config.py:13'): "'GPUS': 2,",
    ('seam', 'experiment/seamv1-pseudovoc/train.py:64'): 'net = nn.DataParallel(net)',
    ('seam', 'lib/net/deeplabv1.py:59'): 'if isinstance(m, nn.Conv2d):',
    ('seam', 'experiment/seamv1-pseudovoc/train.py:96'): 'pred1 = net(inputs.to(0))',
    ('seam', 'experiment/seamv1-pseudovoc/train.py:97'): 'loss = criterion(pred1, seg_label.to(0))',
    ('seam', 'experiment/seamv1-pseudovoc/train.py:98'): 'loss.backward()',
    ('seam', 'experiment/seamv1-pseudovoc/train.py:99'): 'optimizer.step()',
    ('seam', 'experiment/seamv1-pseudovoc/config.py:43'): "'TRAIN_ITERATION': 20000,",
    ('seam', 'experiment/seamv1-pseudovoc/train.py:49'): 'drop_last=True,',
    ('seam', 'experiment/seamv1-pseudovoc/config.py:39'): "'TRAIN_POWER': 0.9,",
    ('seam', 'experiment/seamv1-pseudovoc/train.py:90'): 'now_lr = adjust_lr(optimizer, itr, max_itr, cfg.TRAIN_LR, cfg.TRAIN_POWER)',
    ('seam', 'experiment/seamv1-pseudovoc/train.py:139'): 'now_lr = lr_init * (1 - itr/(max_itr+1)) ** power',
    ('seam', 'lib/net/deeplabv1.py:53'): "result = F.interpolate(result,(h,w),mode='bilinear', align_corners=True)",
    ('seam', 'experiment/seamv1-pseudovoc/train.py:132'): 'torch.save(parameter_source.state_dict(),save_path)',
    ('seam', 'experiment/seamv1-pseudovoc/config.py:46'): "'TEST_MULTISCALE': [0.5, 0.75, 1.0, 1.25, 1.5, 1.75],",
    ('seam', 'experiment/seamv1-pseudovoc/config.py:47'): "'TEST_FLIP': True,",
    ('seam', 'experiment/seamv1-pseudovoc/test.py:88'): 'prob_seg = F.softmax(torch.mean(prob_seg, dim=0, keepdim=True),dim=1)[0]',
    ('seam', 'lib/utils/DenseCRF.py:20'): 'd.addPairwiseGaussian(sxy=3/scale_factor, compat=3)',
    ('seam', 'lib/utils/DenseCRF.py:21'): '#d.addPairwiseBilateral(sxy=80/scale_factor, srgb=13, rgbim=np.copy(img), compat=10)',
    ('seam', 'lib/utils/DenseCRF.py:22'): 'd.addPairwiseBilateral(sxy=32/scale_factor, srgb=13, rgbim=np.copy(img), compat=10)',
    ('seam', 'experiment/seamv1-pseudovoc/test.py:94'): 'prob = dense_crf(prob, img_batched, n_classes=cfg.MODEL_NUM_CLASSES, n_iters=1)',
    ('seam', 'experiment/seamv1-pseudovoc/test.py:93'): "img_batched = img_denorm(sample['image'][0].cpu().numpy()).astype(np.uint8)",
    ('seam', 'lib/utils/imutils.py:50'): 'inputs = inputs*255',
    ('seam', 'lib/utils/imutils.py:51'): 'inputs[inputs > 255] = 255',
    ('seam', 'lib/utils/imutils.py:52'): 'inputs[inputs < 0] = 0',
    ('seam', 'lib/utils/imutils.py:53'): 'inputs = inputs.astype(np.uint8)',
    ('seam', 'experiment/seamv1-pseudovoc/test.py:97'): 'result = torch.argmax(prob_seg, dim=0, keepdim=False).cpu().numpy()',
}


# -- plain readings of the quoted lines ------------------------------------------------------------

def val(text: str, key: str) -> Any:
    """The literal after ``key`` and ``:`` or ``=`` in ``text`` (a list, a quoted string, a number,
    True/False; a bare YAML word as a string)."""
    m = re.search(re.escape(key) + r"""['"]?\s*[:=]\s*(\[[^\]]*\]|'[^']*'|"[^"]*"|[^,\s)}]+)""", text)
    assert m, f"{key!r} not in {text!r}"
    try:
        return ast.literal_eval(m.group(1))
    except (ValueError, SyntaxError):
        return m.group(1)


def mult(text: str, base: str) -> float:
    """The factor of ``base`` in an ``lr`` entry: ``10*args.lr`` -> 10, ``args.lr`` -> 1."""
    m = re.search(r"""['"]lr['"]:\s*(?:(\d+)\s*\*\s*)?""" + re.escape(base), text)
    assert m, f"no lr of {base!r} in {text!r}"
    return float(m.group(1) or 1)


def decayed(text: str) -> bool:
    return val(text, "weight_decay") not in (0, 0.0)


def poly_offset(text: str) -> int:
    """The constant added to poly's denominator: ``t / T`` -> 0, ``itr/(max_itr+1)`` -> 1."""
    m = re.search(r"/\s*\(?\s*[\w.]+\s*(?:\+\s*(\d+))?", text.split("**")[0].split("(1 -")[-1])
    return int(m.group(1) or 0)


def file_name(text: str) -> str:
    return re.search(r"([\w.-]+\.(?:pth|params))", text).group(1)


def preset_of(params: Dict[str, float]) -> str:
    """The CRF_PRESETS name whose parameters are ``params`` (``"none"`` if none is)."""
    found = [name for name, p in CRF_PRESETS.items() if p == params]
    return found[0] if found else f"no preset equals {params}"


def dense_crf_keywords(lines: List[str]) -> Dict[str, float]:
    """pydensecrf's ``addPairwiseGaussian`` / ``addPairwiseBilateral`` keywords of live (not
    commented) lines, in CRF_PRESETS's names (``sxy=3/scale_factor`` at scale_factor 1)."""
    out: Dict[str, float] = {}
    for line in lines:
        if line.startswith("#"):
            continue
        kind = "gaussian" if "addPairwiseGaussian" in line else "bilateral" if "addPairwiseBilateral" in line else ""
        for key in ("sxy", "srgb", "compat"):
            if kind and re.search(rf"\b{key}=", line):
                out[f"{kind}_{key}"] = float(re.search(rf"\b{key}=([\d.]+)", line).group(1))
        if "n_iters=" in line:
            out["iterations"] = val(line, "n_iters")
    return out


#: DeepLab CRF argument names (DHR's DenseCRF, deeplab-pytorch's CRF config) -> CRF_PRESETS keys.
DEEPLAB_CRF_KEYS = {"iter_max": "iterations", "pos_w": "gaussian_compat", "pos_xy_std": "gaussian_sxy",
                    "bi_w": "bilateral_compat", "bi_xy_std": "bilateral_sxy", "bi_rgb_std": "bilateral_srgb"}
#: upstream network names -> build_model's
ARCH_NAMES = {"DeepLabv3plus_with_DHR": "deeplabv3+dhr", "DeepLabV2_ResNet101_MSC": "deeplabv2",
              "deeplabv1": "deeplabv1-wr38"}
BACKBONE_NAMES = {"resnet101": "resnet101", "resnet38": "wr38", (3, 4, 23, 3): "resnet101"}
IMAGENET = (list(deeplab.IMAGENET_MEAN), list(deeplab.IMAGENET_STD))


def stride_product(lines: List[str]) -> int:
    return math.prod(val(line, "stride") if "stride=" in line else 1 for line in lines)


def one_step_per_batch(lines: List[str]) -> int:
    """iter_size from a loop body: one backward then one optimizer step per batch is 1."""
    joined = " ".join(lines)
    assert joined.count("backward()") == 1 and joined.count("optimizer.step()") == 1, joined
    return 1


R = Callable[[List[str]], Any]
READ: Dict[Tuple[str, str], R] = {
    # dhr
    ("dhr", "arch"): lambda L: ARCH_NAMES[re.search(r"networks\.(\w+)\(", L[0]).group(1)],
    ("dhr", "backbone"): lambda L: BACKBONE_NAMES[val(L[0], "'backbone'")],
    ("dhr", "output_stride"): lambda L: val(L[0], "output_stride") if val(L[0], "output_stride") == val(
        L[1], "output_stride") else "train and predict differ",
    ("dhr", "init_weights"): lambda L: file_name(L[0]),
    ("dhr", "weights_format"): lambda L: "torchvision" if "download.pytorch.org/models/" in L[0] else L[0],
    ("dhr", "normalization"): lambda L: "imagenet-rgb" if (val(L[0], "IMAGENET_MEAN"), val(L[1], "IMAGENET_STD")) == IMAGENET
    and "mean=IMAGENET_MEAN, std=IMAGENET_STD" in L[2] else L,
    ("dhr", "augmentation"): lambda L: {"RandomResize,RandomHFlip,ColorJitter,Normalize,RandomCrop": "dhr"}[
        val(L[0], "'train_transform'")],
    ("dhr", "crop"): lambda L: val(L[0], "'image'"),
    ("dhr", "augmentation_params"): lambda L: tuple((ours, val(L[0], f"'{up}'")) for ours, up in (
        ("min_image", "min_image"), ("max_image", "max_image"), ("brightness", "b_factor"), ("contrast", "c_factor"),
        ("saturation", "s_factor"), ("hue", "h_factor"))) + (("hflip", val(L[1], "p")),),
    ("dhr", "optimizer"): lambda L: "sgd" if "optimizers.SGD(" in L[0] else L[0],
    ("dhr", "lr"): lambda L: val(L[0], "'lr'"),
    ("dhr", "momentum"): lambda L: val(L[0], "'momentum'"),
    ("dhr", "nesterov"): lambda L: val(L[0], "'nesterov'"),
    ("dhr", "weight_decay"): lambda L: val(L[0], "'wd'"),
    ("dhr", "lr_mults"): lambda L: tuple(mult(line, "args.lr") for line in L),
    ("dhr", "decay"): lambda L: tuple(decayed(line) for line in L),
    # a plain nn.BatchNorm2d (PyTorch's momentum) that nothing freezes
    ("dhr", "bn"): lambda L: "train" if L[0].endswith("nn.BatchNorm2d") else L[0],
    ("dhr", "bn_momentum"): lambda L: torch.nn.BatchNorm2d(1).momentum if L[0].endswith("nn.BatchNorm2d") else L[0],
    ("dhr", "bn_batch"): lambda L: val(L[0], "'batch'"),
    ("dhr", "bn_head"): lambda L: "train" if "norm=nn.BatchNorm2d" in L[0] else L[0],
    # the four groups take every named parameter, BatchNorm's too
    ("dhr", "bn_affine"): lambda L: "trained" if L[0] == "for name, value in self.named_parameters():" else L[0],
    ("dhr", "batch_size"): lambda L: val(L[0], "'batch'"),
    ("dhr", "iter_size"): one_step_per_batch,
    ("dhr", "epochs"): lambda L: val(L[0], "'epochs'"),
    ("dhr", "iterations"): lambda L: None if "self.train_iterations * self.param.max_epochs" in L[0] else L[0],
    ("dhr", "drop_last"): lambda L: val(L[0], "drop_last"),
    ("dhr", "poly_power"): lambda L: val(L[0], "'power'"),
    # the scheduler steps inside every optimizer step
    ("dhr", "lr_step"): lambda L: 1 if L[0] == "self.scheduler.step()" else L[0],
    ("dhr", "poly_max_offset"): lambda L: poly_offset(L[0]),
    ("dhr", "loss_grid"): lambda L: "logits" if "logits.shape[2:], mode='nearest'" in L[0] else L[0],
    ("dhr", "msc_scales"): lambda L: () if L[0].startswith("output_dict = self.model(images") else L[0],
    ("dhr", "predict_weights"): lambda L: "ema" if "use_ema: model = self.ema.get()" in L[0]
    and L[1].split(",")[1].strip() == "True" else L,
    ("dhr", "ema_decay"): lambda L: val(L[0], "'ema'"),
    ("dhr", "test_scales"): lambda L: tuple(val(L[0], "scales")) if L[1].endswith("apply_ms(image)") else L,
    ("dhr", "test_flip"): lambda L: val(L[0], "hflip"),
    ("dhr", "test_fusion"): lambda L: "mean-softmax" if "torch.mean(torch.stack(pred_masks)" in L[0] else L[0],
    ("dhr", "crf"): lambda L: preset_of({DEEPLAB_CRF_KEYS[k]: val(L[0], k) for k in DEEPLAB_CRF_KEYS})
    if L[1].endswith("DenseCRF(for_seg=True)") else L,
    ("dhr", "crf_image"): lambda L: "denormalized" if "denorm_fn(image)" in L[0]
    and L[1] == "image = (image * 255).astype(np.uint8)" else L,
    ("dhr", "class_threshold"): lambda L: val(L[0], "'threshold'"),
    # deeplab-pytorch
    ("deeplab-pytorch", "arch"): lambda L: ARCH_NAMES[val(L[0], "NAME")],
    ("deeplab-pytorch", "backbone"): lambda L: BACKBONE_NAMES[tuple(val(L[0], "N_BLOCKS"))],
    ("deeplab-pytorch", "output_stride"): lambda L: int(re.search(r"fixed at (\d+)", L[0]).group(1)),
    ("deeplab-pytorch", "init_weights"): lambda L: file_name(L[0]),
    ("deeplab-pytorch", "weights_format"): lambda L: "deeplab-pytorch" if L[0].startswith(
        "model.base.load_state_dict(state_dict") else L[0],
    # cv2 reads BGR; the mean (of bytes) is subtracted, no std
    ("deeplab-pytorch", "normalization"): lambda L: "caffe-bgr" if "cv2.imread" in L[0]
    and L[1] == "image -= self.mean_bgr" else L,
    ("deeplab-pytorch", "augmentation"): lambda L: "deeplab-pytorch" if val(L[0], "augment") is True else L[0],
    ("deeplab-pytorch", "crop"): lambda L: val(L[0], "TRAIN"),
    ("deeplab-pytorch", "augmentation_params"): lambda L: (("scales", tuple(val(L[0], "SCALES"))),
                                                          ("hflip", float(L[1].split("<")[1].rstrip(":")))),
    ("deeplab-pytorch", "optimizer"): lambda L: val(L[0], "OPTIMIZER"),
    ("deeplab-pytorch", "lr"): lambda L: val(L[0], "LR"),
    ("deeplab-pytorch", "momentum"): lambda L: val(L[0], "MOMENTUM"),
    # the SGD call ends after momentum: no nesterov
    ("deeplab-pytorch", "nesterov"): lambda L: False if L[0].startswith("momentum=") and L[1] == ")" else L,
    ("deeplab-pytorch", "weight_decay"): lambda L: val(L[0], "WEIGHT_DECAY"),
    # no backbone conv has a bias (bias=False), so the backbone-bias group is the empty 1x group
    ("deeplab-pytorch", "lr_mults"): lambda L: (lambda m: (m[0], m[0], m[1], m[2]))(
        [mult(line, "CONFIG.SOLVER.LR") for line in L]),
    ("deeplab-pytorch", "decay"): lambda L: (lambda d: (d[0], d[0], d[1], d[2]))([decayed(line) for line in L]),
    ("deeplab-pytorch", "bn"): lambda L: "frozen" if L[0].endswith("freeze_bn()") else L[0],
    ("deeplab-pytorch", "bn_momentum"): lambda L: (lambda a, b: a - b)(
        *map(float, re.search(r"momentum=([\d.]+) - ([\d.]+)\)", L[0]).groups())),
    # every group selects Conv2d modules only: the optimizer holds no BatchNorm parameter
    ("deeplab-pytorch", "bn_affine"): lambda L: "fixed" if all(
        line == "if isinstance(m[1], nn.Conv2d):" for line in L) else L,
    ("deeplab-pytorch", "bn_batch"): lambda L: None if L[0].endswith("freeze_bn()") else L[0],
    # ASPP is four biased convolutions and their sum
    ("deeplab-pytorch", "bn_head"): lambda L: "none" if L[0].startswith("nn.Conv2d(") else L[0],
    ("deeplab-pytorch", "batch_size"): lambda L: val(L[0], "TRAIN"),
    ("deeplab-pytorch", "iter_size"): lambda L: val(L[0], "ITER_SIZE"),
    ("deeplab-pytorch", "epochs"): lambda L: None if L[0].startswith("ITER_MAX:") else L[0],
    ("deeplab-pytorch", "iterations"): lambda L: val(L[0], "ITER_MAX"),
    # DataLoader's default: the last, partial batch is kept
    ("deeplab-pytorch", "drop_last"): lambda L: "drop_last" in " ".join(L),
    ("deeplab-pytorch", "poly_power"): lambda L: val(L[0], "POLY_POWER"),
    ("deeplab-pytorch", "lr_step"): lambda L: val(L[0], "LR_DECAY"),
    ("deeplab-pytorch", "poly_max_offset"): lambda L: poly_offset(L[0]),
    ("deeplab-pytorch", "loss_grid"): lambda L: "logits" if L[0].startswith("labels_ = resize_labels(") else L[0],
    ("deeplab-pytorch", "msc_scales"): lambda L: tuple(val(L[0], "scales")),
    # test loads the state dict train saved (the trained model: no EMA upstream)
    ("deeplab-pytorch", "predict_weights"): lambda L: "student" if L[0] == "model.load_state_dict(state_dict)" else L,
    ("deeplab-pytorch", "ema_decay"): lambda L: None if L[0].startswith("model.module.state_dict()") else L[0],
    ("deeplab-pytorch", "test_scales"): lambda L: (1.0,) + tuple(val(L[1], "scales"))
    if L[0].startswith("logits_all = [logits] + ") else L,
    ("deeplab-pytorch", "test_flip"): lambda L: "flip" in L[0],
    ("deeplab-pytorch", "test_fusion"): lambda L: "max-logits" if "torch.max(torch.stack(logits_all)" in L[0]
    and L[1] == "return logits_max" else L,
    ("deeplab-pytorch", "crf"): lambda L: preset_of({DEEPLAB_CRF_KEYS[k.lower()]: val(line, k) for line in L
                                                     for k in [line.split(":")[0]]}),
    ("deeplab-pytorch", "crf_image"): lambda L: "mean-subtracted" if L[0].startswith("image = image.astype(np.uint8)")
    and L[1] == "image -= self.mean_bgr" else L,
    ("deeplab-pytorch", "class_threshold"): lambda L: None if "torch.argmax(probs" in L[0] else L[0],
    # seam
    ("seam", "arch"): lambda L: ARCH_NAMES[val(L[0], "'MODEL_NAME'")],
    ("seam", "backbone"): lambda L: BACKBONE_NAMES[val(L[0], "'MODEL_BACKBONE'")],
    ("seam", "output_stride"): stride_product,
    ("seam", "init_weights"): lambda L: file_name(L[0]),
    ("seam", "weights_format"): lambda L: "wr38" if "convert_mxnet_to_torch(" in L[0] else L[0],
    ("seam", "normalization"): lambda L: "imagenet-rgb" if (val(L[0], "'DATA_MEAN'"), val(L[1], "'DATA_STD'")) == IMAGENET
    and "COLOR_BGR2RGB" in L[2] else L,
    ("seam", "augmentation"): lambda L: "seam" if val(L[0], "transform") == "weak" and "weak" in L[1] else L,
    ("seam", "crop"): lambda L: val(L[0], "'DATA_RANDOMCROP'"),
    ("seam", "augmentation_params"): lambda L: (("scale", tuple(val(L[0], "'DATA_RANDOMSCALE'"))),
                                               ("hsv", tuple(val(line, f"'DATA_RANDOM_{c}'")
                                                             for line, c in zip(L[1:4], "HSV"))),
                                               ("hflip", val(L[4], "'DATA_RANDOMFLIP'"))),
    ("seam", "optimizer"): lambda L: "sgd" if "optim.SGD(" in L[0] else L[0],
    ("seam", "lr"): lambda L: val(L[0], "'TRAIN_LR'"),
    ("seam", "momentum"): lambda L: val(L[0], "'TRAIN_MOMENTUM'"),
    ("seam", "nesterov"): lambda L: False if L[-1] == ")" and "nesterov" not in " ".join(L) else L,
    ("seam", "weight_decay"): lambda L: val(L[0], "'TRAIN_WEIGHT_DECAY'"),
    ("seam", "lr_mults"): lambda L: tuple(mult(line, "cfg.TRAIN_LR") for line in L),
    ("seam", "decay"): lambda L: tuple(decayed(line) for line in L),
    ("seam", "bn"): lambda L: "frozen" if val(L[0], "'MODEL_FREEZEBN'") else "train",
    ("seam", "bn_head"): lambda L: "train" if "momentum=cfg.TRAIN_BN_MOM" in L[0] else L[0],
    ("seam", "bn_momentum"): lambda L: val(L[0], "'TRAIN_BN_MOM'") if val(L[0], "'TRAIN_BN_MOM'") == val(
        L[1], "bn_mom") else L,
    ("seam", "bn_affine"): lambda L: "fixed" if L[0] == "if isinstance(m, nn.Conv2d):" else L[0],
    # DataParallel splits the batch over the GPUs; each replica's BatchNorm sees its share
    ("seam", "bn_batch"): lambda L: val(L[0], "'TRAIN_BATCHES'") // val(L[1], "'GPUS'")
    if "nn.DataParallel(net)" in L[2] else L,
    ("seam", "batch_size"): lambda L: val(L[0], "'TRAIN_BATCHES'"),
    ("seam", "iter_size"): one_step_per_batch,
    ("seam", "epochs"): lambda L: None if "'TRAIN_ITERATION'" in L[0] else L[0],
    ("seam", "iterations"): lambda L: val(L[0], "'TRAIN_ITERATION'"),
    ("seam", "drop_last"): lambda L: val(L[0], "drop_last"),
    ("seam", "poly_power"): lambda L: val(L[0], "'TRAIN_POWER'"),
    ("seam", "lr_step"): lambda L: 1 if L[0].startswith("now_lr = adjust_lr(optimizer, itr,") else L[0],
    ("seam", "poly_max_offset"): lambda L: poly_offset(L[0]),
    ("seam", "loss_grid"): lambda L: "input" if "F.interpolate(result,(h,w)" in L[0] else L[0],
    ("seam", "msc_scales"): lambda L: () if L[0].startswith("pred1 = net(inputs") else L[0],
    ("seam", "predict_weights"): lambda L: "student" if "parameter_source.state_dict()" in L[0] else L[0],
    ("seam", "ema_decay"): lambda L: None if "parameter_source.state_dict()" in L[0] else L[0],
    ("seam", "test_scales"): lambda L: tuple(val(L[0], "'TEST_MULTISCALE'")),
    ("seam", "test_flip"): lambda L: val(L[0], "'TEST_FLIP'"),
    ("seam", "test_fusion"): lambda L: "mean-logits" if "F.softmax(torch.mean(prob_seg" in L[0] else L[0],
    ("seam", "crf"): lambda L: preset_of(dense_crf_keywords(L)),
    ("seam", "crf_image"): lambda L: "denormalized" if "img_denorm(" in L[0] and L[1:] == [
        "inputs = inputs*255", "inputs[inputs > 255] = 255", "inputs[inputs < 0] = 0",
        "inputs = inputs.astype(np.uint8)"] else L,
    ("seam", "class_threshold"): lambda L: None if "torch.argmax(prob_seg" in L[0] else L[0],
}


def cited(source: str) -> List[str]:
    """The "path:line" of every line a source names ("a.py:3-5 + b.py:7" -> 4 lines)."""
    out = []
    for part in source.split(" + "):
        path, lines = part.rsplit(":", 1)
        first, last = (lines.split("-") + [lines])[:2]
        out += [f"{path}:{n}" for n in range(int(first), int(last) + 1)]
    return out


FIELDS = [(name, f.name) for name, r in RECIPES.items() for f in dataclasses.fields(Recipe)
          if f.name not in META_FIELDS and f.name in r.sources]


def test_every_field_is_cited_and_read() -> None:
    """Every field of every recipe cites upstream, and has a reading here; no stale quote or reader."""
    for name, recipe in RECIPES.items():
        fields = {f.name for f in dataclasses.fields(Recipe)} - set(META_FIELDS)
        assert fields <= set(recipe.sources), f"{name}: uncited fields {sorted(fields - set(recipe.sources))}"
    assert set(READ) == set(FIELDS)
    used = {(n, line) for n, f in FIELDS for line in cited(RECIPES[n].sources[f])}
    assert set(QUOTED) == used, f"quoted but not cited: {set(QUOTED) - used}; cited, not quoted: {used - set(QUOTED)}"


@functools.lru_cache(maxsize=None)
def _mirror_file(upstream: str, path: str) -> Optional[List[str]]:
    repo, commit = upstream.split("@")
    git_dir = MIRRORS / repo.replace("/", "+") / "repo"
    if not git_dir.is_dir():
        return None
    out = subprocess.run(["git", "-C", str(git_dir), "show", f"{commit}:{path}"], capture_output=True, text=True)
    assert out.returncode == 0, f"{upstream}: {path}: {out.stderr.strip()}"
    return out.stdout.split("\n")


@pytest.mark.parametrize("name,field", FIELDS)
def test_field_quotes_the_mirror(name: str, field: str) -> None:
    recipe = RECIPES[name]
    for where in cited(recipe.sources[field]):
        path, line = where.rsplit(":", 1)
        text = _mirror_file(recipe.upstream, path)
        if text is None:
            pytest.skip(f"no mirror of {recipe.upstream} under {MIRRORS}")
        assert text[int(line) - 1].strip() == QUOTED[(name, where)], f"{name}.{field}: {where}"


@pytest.mark.parametrize("name,field", FIELDS)
def test_field_is_the_plain_reading(name: str, field: str) -> None:
    recipe = RECIPES[name]
    lines = [QUOTED[(name, where)] for where in cited(recipe.sources[field])]
    assert getattr(recipe, field) == READ[(name, field)](lines), f"{name}.{field} vs {recipe.sources[field]}"


def test_seam_trains_with_its_backbone_as_constructed() -> None:
    """resnet38d's ``train()`` override (BatchNorm in eval, conv1a frozen) only runs when
    something calls ``.train()``: SEAM's train.py never does, so its backbone BatchNorm keeps
    training and conv1a is in the optimizer (``bn = "train"``, no frozen layer)."""
    text = _mirror_file(RECIPES["seam"].upstream, "experiment/seamv1-pseudovoc/train.py")
    if text is None:
        pytest.skip("no mirror of SEAM's codebase")
    assert not [line for line in text if ".train(" in line]
    assert RECIPES["seam"].bn == "train"


# -- epochs to iterations ------------------------------------------------------------------------

def test_dhr_voc_train_aug_is_66100_iterations() -> None:
    recipe = get_recipe("dhr")
    assert iterations_for_epochs(10582, recipe.epochs, recipe.batch_size, recipe.drop_last) == 66100


@pytest.mark.parametrize("n,batch,drop_last", [(10582, 16, True), (37, 5, True), (37, 5, False), (40, 8, True),
                                               (7, 8, False), (1, 1, True)])
def test_iterations_are_len_of_a_dataloader(n: int, batch: int, drop_last: bool) -> None:
    loader = DataLoader(range(n), batch_size=batch, drop_last=drop_last)
    assert iterations_for_epochs(n, 3, batch, drop_last) == 3 * len(loader)


@pytest.mark.parametrize("n,batch,world,drop_last", [(10582, 16, 4, True), (10582, 16, 2, True), (37, 6, 3, True),
                                                     (38, 4, 4, True), (37, 6, 3, False), (39, 2, 2, False)])
def test_iterations_under_distributed_sampler(n: int, batch: int, world: int, drop_last: bool) -> None:
    """DHR under torchrun: every rank's DistributedSampler(drop_last) and a loader of batch // world."""
    for rank in range(world):
        sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, drop_last=drop_last)
        loader = DataLoader(range(n), batch_size=batch // world, sampler=sampler, drop_last=drop_last)
        assert iterations_for_epochs(n, 2, batch, drop_last, world=world) == 2 * len(loader)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_images=5, epochs=1, global_batch=16), "no full batch"),
    (dict(num_images=100, epochs=1, global_batch=16, world=3), "multiple of world"),
    (dict(num_images=0, epochs=1, global_batch=16), "num_images"),
    (dict(num_images=100, epochs=0, global_batch=16), "epochs"),
    (dict(num_images=100, epochs=1, global_batch=0), "global_batch"),
    (dict(num_images=100, epochs=1, global_batch=4, drop_last=1), "drop_last"),
])
def test_iterations_for_epochs_refuses(kwargs: Dict[str, Any], match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        iterations_for_epochs(**kwargs)


# -- the poly learning rate ----------------------------------------------------------------------

def _upstream_factors(name: str, total: int) -> List[float]:
    """The lr factor of each optimizer step, written from each upstream's definition as a loop."""
    out, factor = [], 1.0
    for step in range(total):
        if name == "seam":  # train.py:139: set before the step from the 0-based itr, over max_itr + 1
            factor = (1 - step / (total + 1)) ** 0.9
        out.append(factor)
        i = step + 1  # the 1-based count of steps taken so far
        if name == "dhr" and i < total:  # schedulers.py:36-42, after every step
            factor = (1 - i / total) ** 0.9
        if name == "deeplab-pytorch" and i % 10 == 0 and i <= total:  # lr_scheduler.py:22-29, step(epoch=i)
            factor = (1 - i / total) ** 0.9
    return out


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_poly_factor_is_upstream_schedule(name: str) -> None:
    recipe = get_recipe(name)
    for total in (1, 9, 10, 37, 100):
        ours = [poly_factor(recipe, t, total) for t in range(total)]
        assert ours == pytest.approx(_upstream_factors(name, total), rel=1e-12, abs=0)


# -- overrides, immutability, storage ------------------------------------------------------------

def test_get_recipe_names_the_choices() -> None:
    assert get_recipe("seam") is RECIPES["seam"]
    with pytest.raises(ValueError, match=r"recipe must be one of \['dhr', 'deeplab-pytorch', 'seam'\], got 'irnet'"):
        get_recipe("irnet")


def test_overrides_replace_and_record() -> None:
    base = get_recipe("dhr")
    new, names = with_overrides(base, lr=0.01, iterations=30000, output_stride=16)
    assert (new.lr, new.iterations, new.epochs, new.output_stride) == (0.01, 30000, None, 16)
    assert names == ["output_stride", "lr", "iterations"]  # the recipe's field order
    assert new.sources["lr"] == "override" and new.sources["batch_size"] == base.sources["batch_size"]
    assert (base.lr, base.epochs, base.iterations) == (1e-3, 100, None)  # the recipe itself is untouched
    again, names = with_overrides(new, epochs=5)
    assert (again.epochs, again.iterations, names) == (5, None, ["epochs"])
    same, names = with_overrides(base)
    assert same == base and names == []


@pytest.mark.parametrize("fields,error,match", [
    (dict(lr=-1.0), ValueError, r"lr must be a finite number in \(0, inf\), got -1.0"),
    (dict(lr="big"), TypeError, r"lr must be a finite number"),
    (dict(momentum=1.0), ValueError, r"momentum must be a finite number in \[0, 1\), got 1.0"),
    (dict(output_stride=32), ValueError, r"output_stride must be one of \[8, 16\], got 32"),
    (dict(batch_size=0), ValueError, r"batch_size must be an integer >= 1, got 0"),
    (dict(batch_size=2.0), TypeError, r"batch_size must be an integer >= 1, got float 2.0"),
    (dict(nesterov=1), TypeError, r"nesterov must be True or False, got int 1"),
    (dict(crf="dense"), ValueError, r"crf must be 'none' or a CRF preset .*got 'dense'"),
    (dict(predict_weights="teacher"), ValueError,
     r"predict_weights must be one of \['ema', 'student'\], got 'teacher'"),
    (dict(lr_mults=(1.0, 10.0)), TypeError, r"lr_mults must be a tuple of 4 numbers"),
    (dict(decay=(True, True, True, 0)), TypeError, r"decay\[3\] must be True or False"),
    (dict(test_scales=()), ValueError, r"test_scales must not be empty"),
    (dict(class_threshold=1.5), ValueError, r"class_threshold must be a finite number in \[0, 1\)"),
    (dict(epochs=None), ValueError, r"exactly one of epochs and iterations must be set"),
    (dict(ema_decay=None), ValueError, r"predict_weights 'ema' needs ema_decay"),
    (dict(learning_rate=0.1), ValueError, r"'learning_rate' is not a recipe field"),
    (dict(name="mine"), ValueError, r"recipe field 'name' says where the recipe comes from"),
    (dict(sources={}), ValueError, r"recipe field 'sources'"),
])
def test_overrides_are_checked(fields: Dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        with_overrides(get_recipe("dhr"), **fields)


def test_recipes_are_immutable() -> None:
    recipe = get_recipe("dhr")
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.lr = 0.1  # type: ignore[misc]
    with pytest.raises(TypeError):
        recipe.sources["lr"] = "mine"  # type: ignore[index]
    with pytest.raises(TypeError):
        RECIPES["mine"] = recipe  # type: ignore[index]
    assert isinstance(recipe.lr_mults, tuple) and isinstance(recipe.augmentation_params, tuple)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_round_trips_through_a_weights_only_checkpoint(name: str, tmp_path: Path) -> None:
    recipe, _ = with_overrides(get_recipe(name), lr=0.5)
    torch.save({"recipe": recipe_to_dict(recipe)}, tmp_path / "m.pt")
    assert recipe_from_dict(torch.load(tmp_path / "m.pt", weights_only=True)["recipe"]) == recipe


def test_stored_recipe_is_checked() -> None:
    data = recipe_to_dict(get_recipe("seam"))
    with pytest.raises(ValueError, match=r"unknown fields \['colour'\], missing fields \[\]"):
        recipe_from_dict({**data, "colour": 1})
    del data["crop"]
    with pytest.raises(ValueError, match=r"missing fields \['crop'\]"):
        recipe_from_dict(data)
    with pytest.raises(ValueError, match=r"crop must be an integer >= 1, got -3"):
        recipe_from_dict({**recipe_to_dict(get_recipe("seam")), "crop": -3})


# ----------------------------------------------------------------------------------------------
# Issue 41, class 7: every setting means what it says. A recipe field given to ``mars train``
# (TrainSettings, which mars train, reproduce --train and the API build) is refused, naming it
# and the recipe, exactly where the run would not read it (mars_plugin/commands/recipe_uses.py);
# everywhere else it changes the run. Checked for every (recipe, field) against the code that
# consumes the settings, not against the table.

from mars_plugin.commands.recipe_uses import UNUSED  # noqa: E402
from mars_plugin.commands.train_settings import RECIPE_FIELDS, TrainSettings  # noqa: E402


def _run_fingerprint(s: TrainSettings) -> Dict[str, Any]:
    """What a run of ``s`` does with its recipe fields, read from the code that runs it (without
    training): the network built (on the meta device), the optimizer ``train._optimizer`` makes
    of it (class, every group's lr / momentum / decay ..., its size), one training sample
    (``seg_data.train_sample`` of ``s.augmentation``), the labels on the loss grid
    (``train_dhr.loss_labels``; MSC takes its own), the schedule and the batch."""
    import numpy as np
    import torch.nn as nn

    from mars_plugin.commands.train import _optimizer
    from mars_plugin.commands.train_dhr import loss_labels
    from mars_plugin.networks.deeplab import build_model
    from mars_plugin.networks.deeplabv2 import MSC
    from mars_plugin.networks.seg_data import train_sample

    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (30, 44, 3), dtype=np.uint8)
    lab = rng.integers(0, 3, (30, 44), dtype=np.uint8)
    image, _, lab_c = train_sample(rgb, lab, s.augmentation, np.random.default_rng(1))
    with torch.device("meta"):
        model = build_model(**s.model)
        if s.spec.msc_scales:
            model = MSC(model, s.spec.msc_scales)
    if s.bn == "frozen":  # as train._build
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                for p in m.parameters():
                    p.requires_grad_(False)
    opt = _optimizer(s, model)
    groups = [(type(opt).__name__, len(g["params"]), sorted((k, repr(v)) for k, v in g.items() if k != "params"))
              for g in opt.param_groups]
    y = torch.from_numpy(lab_c.astype(np.int64))[None]
    grid = None if s.spec.msc_scales else loss_labels(s, y).numpy().tobytes()
    return {"model": s.model, "bn": s.bn, "groups": groups, "image": image.numpy().tobytes(), "label": lab_c.tobytes(),
            "grid": grid, "steps": s.iterations_for(40), "poly": [poly_factor(s, t, 30) for t in range(30)],
            "batch": (s.batch_size, s.iter_size)}


_WR38_ELSE = dict(arch="deeplabv2", backbone="resnet50", bn="frozen")  # SEAM's network takes wr38 only


def _probe(recipe: str, field: str) -> Dict[str, Any]:
    """A value of ``field`` other than the ``recipe``'s resolved one (with what it needs)."""
    s = TrainSettings(num_classes=2, recipe=recipe)
    v = getattr(s, field)
    if field in ("arch", "backbone"):
        if s.backbone == "wr38":
            return dict(_WR38_ELSE)
        return {"arch": "deeplabv3+"} if field == "arch" else {"backbone": "resnet50"}
    flip = {1.0: 3.0, 10.0: 5.0, 20.0: 7.0, 2.0: 4.0}
    other = {
        "output_stride": lambda: 16, "bn": lambda: "frozen" if v == "train" else "train", "epochs": lambda: 3,
        "iterations": lambda: 7, "batch_size": lambda: v + 2, "iter_size": lambda: v + 1, "crop": lambda: 64,
        "min_size": lambda: 300, "max_size": lambda: 700, "optimizer": lambda: "adamw", "lr": lambda: v * 2,
        "momentum": lambda: 0.5, "weight_decay": lambda: v * 3, "poly_power": lambda: 1.5, "lr_step": lambda: v + 4,
        "loss_grid": lambda: "input" if v == "logits" else "logits",
        # the backbone biases' entry: the group some networks leave empty
        "lr_mults": lambda: (v[0], flip[v[1]], v[2], v[3]), "decay": lambda: (v[0], not v[1], v[2], v[3]),
    }
    return {field: other[field]()}


#: beyond the recipes' own values: the cases where a field's use depends on another setting
_COMBINED = [
    ("dhr", {"optimizer": "adamw"}, {"momentum": 0.5}),  # AdamW has no momentum
    ("dhr", {"arch": "deeplabv3+", "backbone": "resnet18"}, {"loss_grid": "input"}),  # logits at the crop's size
    ("seam", dict(_WR38_ELSE), {"loss_grid": "logits"}),  # deeplabv2's stride-8 logits: the grid matters
    ("dhr", {"lr_mults": (1.0, 1.0, 10.0, 10.0)}, {"lr_mults": (3.0, 1.0, 10.0, 10.0)}),
    ("deeplab-pytorch", {}, {"lr_mults": (1.0, 1.0, 10.0, 7.0)}),  # the head biases' group is used
    ("seam", {}, {"decay": (False, False, True, False)}),
    # frozen BatchNorm holds every backbone bias of a torchvision ResNet: that group is empty
    ("dhr", {"bn": "frozen"}, {"lr_mults": (1.0, 3.0, 10.0, 10.0)}),
    ("dhr", {"bn": "train"}, {"decay": (True, False, True, True)}),
    ("deeplab-pytorch", {"arch": "deeplabv3+"}, {"decay": (True, False, True, False)}),
    ("seam", dict(_WR38_ELSE), {"lr_mults": (1.0, 5.0, 10.0, 20.0)}),
]
_CASES = [(r, {}, _probe(r, f)) for r in RECIPES for f in RECIPE_FIELDS] + _COMBINED


@pytest.mark.parametrize("recipe,base,change", _CASES,
                         ids=[f"{r}-{'+'.join(b)}-{'+'.join(c)}" for r, b, c in _CASES])
def test_a_recipe_field_is_refused_exactly_where_the_run_ignores_it(recipe, base, change) -> None:
    """Every (recipe, field) of mars train: a value given either changes what the run does or is
    refused with one line naming the field and the recipe; never recorded and ignored."""
    before = _run_fingerprint(TrainSettings(num_classes=2, recipe=recipe, **base))
    try:
        after_s = TrainSettings(num_classes=2, recipe=recipe, **{**base, **change})
    except ValueError as e:
        field = [k for k in change if k in str(e)][0]
        assert re.fullmatch(rf"{field}(\[\d\])? is not used by the {recipe} recipe \(.+\); leave it out", str(e)), e
        assert any(row.field == field for row in UNUSED)
        # ... and it would indeed change nothing: the same run without the check
        import mars_plugin.commands.recipe_uses as uses

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(uses, "check_used", lambda s: None)
            assert _run_fingerprint(TrainSettings(num_classes=2, recipe=recipe, **{**base, **change})) == before
        return
    try:
        after = _run_fingerprint(after_s)
    except ValueError as e:  # the network refuses the value (deeplabv2 and WR38 have output stride 8 only)
        assert "output_stride" in str(e) and list(change) == ["output_stride"], e
        return
    assert after != before, f"{change} is recorded as an override of the {recipe} recipe but changes nothing"


@pytest.mark.parametrize("recipe, grid", [("deeplab-pytorch", "input"), ("seam", "logits")])
def test_loss_grid_the_recipe_ignores_is_refused_on_the_command_line(recipe, grid, tmp_path, capsys) -> None:
    """mars train --loss-grid with deeplab-pytorch (MSC: each output's own grid) or seam (logits
    at the crop's size) used to be recorded and to train bit-identically: exit 2, one line naming
    the flag and the recipe, nothing written."""
    from mars_plugin import cli

    from test_train import _tree

    root = _tree(tmp_path / "t", n=2, size=20)
    out = tmp_path / "run"
    code = cli.main(["train", "--recipe", recipe, "--loss-grid", grid, "--images", str(root / "images"),
                     "--labels", str(root / "debiased"), "--out", str(out), "--num-classes", "4", "--iterations", "1",
                     "--batch-size", "2", "--crop", "16", "--workers", "0", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"mars train: error: --loss-grid is not used by the {recipe} recipe (")
    assert not out.exists()


def test_ema_1_is_refused_naming_the_flag_and_the_range(capsys) -> None:
    """--ema 1 trains against a teacher frozen at its random initialisation (Sec. 3.4's EMA never
    moves it): refused by the flag (exit 2) and by the settings record (the API, reproduce)."""
    from mars_plugin.commands.cli_parser import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["train", "--images", "i", "--labels", "l", "--out", "o", "--ema", "1"])
    assert e.value.code == 2
    assert re.search(r"--ema: expected a finite number in \[0, 1\), got 1 \(.*random initialisation",
                     capsys.readouterr().err)
    with pytest.raises(ValueError, match=r"ema must be in \[0, 1\), got 1.0: momentum 1 keeps the teacher at its "
                                         r"random initialisation"):
        TrainSettings(num_classes=2, ema=1.0)
    assert TrainSettings(num_classes=2, ema=0.0).ema == 0.0  # 0: the teacher is the student, a meaningful end
    assert TrainSettings(num_classes=2, loss="ce", ema=None).ema is None


# ----------------------------------------------------------------------------------------------
# Issue 41, class 9 (the predict item): a settings conflict is refused once, before the first
# image, with one line naming the flag; not reported as every image's failure.

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Tuple[Path, Path, Path]:
    """(images, a deeplab-pytorch checkpoint, a deeplabv3+ checkpoint of the dhr recipe), as
    train._save writes them (random weights: what is predicted does not matter here)."""
    from mars_plugin.networks.deeplab import build_model
    from mars_plugin.networks.deeplabv2 import MSC
    from mars_plugin.networks.seg_checkpoint import save_checkpoint

    from test_train import _tree

    root = _tree(tmp_path_factory.mktemp("predict_conflicts"), n=2, size=36)
    paths = []
    for name, s in (("dlpt", TrainSettings(num_classes=4, recipe="deeplab-pytorch", backbone="resnet50", loss="ce")),
                    ("dhr", TrainSettings(num_classes=4, arch="deeplabv3+", backbone="resnet18", loss="ce"))):
        torch.manual_seed(0)
        model = build_model(**s.model)
        msc = list(s.spec.msc_scales)
        if msc:
            model = MSC(model, tuple(msc))
        save_checkpoint(root / f"{name}.pt", {"recipe": s.recipe, "iteration": 1, "student": model.state_dict(),
                                              "model": {**s.model, **({"msc_scales": msc} if msc else {})},
                                              "teacher": None, "settings": s.record(), "class_names": None})
        paths.append(root / f"{name}.pt")
    return root / "images", paths[0], paths[1]


@pytest.mark.parametrize("which, flags, line", [
    ("dlpt", ["--flip"], "--flip is not possible with a deeplab-pytorch network: its scales are fused by the max"),
    ("dlpt", ["--crf-image", "denormalized"], "--crf-image 'denormalized' turns back another input than this "
                                              "network's (BGR minus the caffe mean (deeplabv2)); use 'mean-subtracted'"),
    ("dhr", ["--crf-image", "mean-subtracted"], "--crf-image 'mean-subtracted' turns back another input than this "
                                                "network's (RGB over ImageNet's mean and std); use 'denormalized'"),
])
def test_a_predict_setting_the_network_cannot_honour_is_refused_before_any_image(
        checkpoints, which, flags, line, tmp_path, capsys, monkeypatch) -> None:
    """mars predict --flip on a deeplab-pytorch checkpoint (MSC's max of the logits has no flip)
    used to fail every image one by one; CRF bytes turned back from another input than the
    network's were wrong without a word. Exit 2, one line, no image read, nothing written."""
    import mars_plugin.commands.predict as pr
    from mars_plugin import cli

    images, dlpt, dhr = checkpoints
    read = []
    real_read = pr._read
    monkeypatch.setattr(pr, "_read", lambda job, path: read.append(path) or real_read(job, path))
    out = tmp_path / "pred"
    code = cli.main(["predict", "--model", str(dlpt if which == "dlpt" else dhr), "--images", str(images),
                     "--out", str(out), "--no-progress", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"mars predict: error: {line}"), err
    assert read == [] and not out.exists()
    # the same flags that fit the network run
    fit = {"--flip": "--no-flip", "denormalized": "file", "mean-subtracted": "denormalized"}
    assert cli.main(["predict", "--model", str(dlpt if which == "dlpt" else dhr), "--images", str(images), "--out",
                     str(out), "--no-progress", *[fit.get(f, f) for f in flags]]) == 0
    assert len(read) == 2


@pytest.mark.parametrize("flags, named", [
    (["--class-threshold", "0.1"], "--class-threshold is"),
    (["--crf-image", "file"], "--crf-image is"),
    (["--class-threshold", "0", "--crf-image", "denormalized"], "--class-threshold and --crf-image are"),
])
def test_predict_crf_settings_without_a_crf_are_refused(flags, named) -> None:
    """--crf none takes the argmax: a CRF setting given with it is refused, not recorded unused."""
    from mars_plugin.commands.cli_parser import build_parser
    from mars_plugin.commands.predict_recipe import predict_settings

    args = build_parser().parse_args(["predict", "--model", "m", "--images", "i", "--out", "o", "--crf", "none",
                                      *flags])
    for meta in ({}, {"recipe": "dhr"}):
        with pytest.raises(ValueError, match=rf"^{named} not used with --crf none \(the argmax"):
            predict_settings(args, meta)
    args = build_parser().parse_args(["predict", "--model", "m", "--images", "i", "--out", "o", "--crf", "none"])
    assert predict_settings(args, {"recipe": "dhr"})["crf"] == "none"
