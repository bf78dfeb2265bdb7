-- moe.Event: timing points on a device's queue (CPU always; CUDA where a GPU is).
local moe = require "moe"

describe("moe.Event", function()
  it("times CPU work", function()
    local a, b = moe.Event("cpu"), moe.Event()
    assert.are.equal(a, a:record())
    local x = moe.randn{256, 256}
    for _ = 1, 10 do (x * x):free() end
    b:record()
    b:synchronize()
    local ms = a:elapsed(b)
    assert.is_true(ms > 0 and ms < 60000)
    a:free(); b:free(); x:free()
  end)

  it("gives clear errors", function()
    local a, b = moe.Event(), moe.Event()
    assert.has_error(function() a:elapsed(b) end, "elapsed: both events must be recorded first (the start event was not)")
    assert.error_matches(function() a:elapsed(3) end, "bad argument #2 to 'elapsed' %(event expected, got number%)")
    assert.error_matches(function() moe.Event("tpu") end, "bad argument #1 to 'Event'")
    if not moe.cuda.is_available() then
      assert.error_matches(function() moe.Event("cuda") end, "bad argument #1 to .Event. %(device .cuda.: cuda:0 requested but .*CUDA")
    end
    a:free()
    assert.error_matches(function() a:record() end, "attempt to use a freed event")
    a:free() -- idempotent
    assert.are.equal("moe.Event (freed)", tostring(a))
    b:free()
  end)

  it("closes with <close>", function()
    do
      local e <close> = moe.Event()
      e:record()
    end
  end)

  it("times CUDA work when a GPU is visible", function()
    if not moe.cuda.is_available() then
      print("SKIPPED (no CUDA GPU): CUDA events")
      return
    end
    local a, b = moe.Event("cuda"), moe.Event("cuda")
    local x = moe.randn({1 << 22}, {device = "cuda"})
    a:record()
    for _ = 1, 10 do (x * x):free() end
    b:record()
    b:synchronize()
    assert.is_true(a:elapsed(b) > 0)
    assert.error_matches(function() a:elapsed(moe.Event("cpu"):record()) end, "the start event is on cuda:0 but the end event is on cpu")
    a:free(); b:free(); x:free()
  end)
end)
