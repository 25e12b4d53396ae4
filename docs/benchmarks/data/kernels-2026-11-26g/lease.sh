# One-off GPU lease (not committed): GPU 0 checks and tunes the WMMA split-K, then fsearch;
# GPU 1 runs ms.tune_tir at 512 trials, then tunes the wgmma convolution.
S=$1; mkdir -p $S
CONV="conv2d_nchw N=8 CI=256 H=14 W=14 CO=256 KH=3 KW=3 pad=1 dtype=float16"
( CUDA_VISIBLE_DEVICES=0 CHECK_CASES="$CONV;conv2d_nchw N=4 CI=64 H=16 W=16 CO=128 KH=3 KW=3 stride=2 pad=1 dtype=float16;group_conv2d_nchw N=2 CI=64 H=8 W=8 CO=64 KH=3 KW=3 groups=2 pad=1 dtype=float16;matmul M=256 N=128 K=256 dtype=float16" \
  KERNEL_CASES="$CONV" FSEARCH_CASES="resnet-last-conv;conv2d_nchw N=1 CI=256 H=14 W=14 CO=256 KH=3 KW=3 pad=1" \
  bash bench/gpu_session.sh $S/gpu0 check kernels fsearch > $S/gpu0.out 2>&1 ) &
( CUDA_VISIBLE_DEVICES=1 VSMS_CASES="matmul M=1024 N=1024 K=1024" MS_TRIALS=512 bash bench/gpu_session.sh $S/gpu1 vsms > $S/gpu1.out 2>&1
  CUDA_VISIBLE_DEVICES=1 KERNEL_TARGET='{"kind": "cuda", "arch": "sm_90a"}' KERNEL_CASES="$CONV" bash bench/gpu_session.sh $S/gpu1b kernels > $S/gpu1b.out 2>&1 ) &
wait; touch $S/DONE
